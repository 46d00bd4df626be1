"""Start-up time of the CLI: `dlaunch --help` (target <= 0.10 s) and `dlaunch run --help`
(target <= 0.15 s), each a new process timed from spawn to exit, median of --repeats.

    .venv/bin/python benchmarks/cli_start.py [--repeats 7] [--module]

Both only build the parser: no command module is imported (see launcher.cli.main's COMMANDS),
so what they measure is the interpreter plus launcher.cli.args and its light imports. Runs the
`dlaunch` console script beside this interpreter (what a user types), or with --module (or
without that script) `python -m launcher.cli.main` in this checkout. Bytecode is written as by
any install (PYTHONDONTWRITEBYTECODE is dropped for the children): with it set, every edited
module is compiled from source on each start, which is not what a user waits for. Prints the
host's CPU model and load average: on a busy or slow host the numbers move, and they are only
comparable on the same one.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = Path(sys.executable).parent / "dlaunch"
MODULE = [sys.executable, "-m", "launcher.cli.main"]
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
CASES = {"dlaunch --help": (["--help"], 0.10), "dlaunch run --help": (["run", "--help"], 0.15)}


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux), and how many cores this process may use."""
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                name = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{name}, {cores} usable cores"


def timed(argv: list[str]) -> float:
    """Seconds from spawning `argv` to its exit; raises if it fails."""
    t0 = time.perf_counter()
    subprocess.run(argv, cwd=REPO, env=ENV, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    """Time each case, alternating (a slow moment of the host hits both), and print medians."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--module", action="store_true",
                        help="time `python -m launcher.cli.main` in this checkout, not the console script")
    args = parser.parse_args()
    dlaunch = MODULE if args.module or not SCRIPT.is_file() else [str(SCRIPT)]
    print(f"host: {cpu_model()}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"command: {' '.join(dlaunch)}")
    for argv, _ in CASES.values():  # one untimed run each: .pyc files written, page cache warm
        timed([*dlaunch, *argv])
    times: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(args.repeats):
        for name, (argv, _) in CASES.items():
            times[name].append(timed([*dlaunch, *argv]))
    for name, values in times.items():
        median, target = statistics.median(values), CASES[name][1]
        verdict = "ok" if median <= target else "OVER"
        print(f"{name:20s} median {median:.3f} s  range {min(values):.3f}-{max(values):.3f} s  "
              f"({len(values)} runs; target <= {target:.2f} s: {verdict})")
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()

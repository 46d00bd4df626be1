"""Wall time of `dlaunch plan` for Llama-3 70B on 1,024 H100s (target, issue 22: <= 1.5 s cold
median of 7, torch import included, without --global-batch) and of `dlaunch --help` (<= 0.10 s).

    .venv/bin/python benchmarks/plan_cold.py [--repeats 7]

Cold: a fresh, empty profile cache (DLAUNCH_CACHE_DIR) per repeat, so every run imports torch
and profiles the model on the meta device. Warm: the cache from the previous run. Each is a
new `dlaunch` process, timed from spawn to exit; medians and ranges over repeats.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DLAUNCH = [sys.executable, "-m", "launcher.cli.main"]
# no --global-batch: the planner then also searches the global batch (the slower case)
PLAN = ["plan", "workloads/gpt.py", "--topology", "topologies/h100-sxm-8x128node-ib.yaml",
        "--", "--size", "llama3-70b"]


def timed(argv: list[str], env: dict[str, str]) -> float:
    """Seconds from spawning `argv` to its exit; raises if it fails."""
    t0 = time.perf_counter()
    subprocess.run(argv, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    """Time --help, cold plan and warm plan, alternating, and print medians."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"help": [], "cold": [], "warm": []}
    for _ in range(args.repeats):
        cache = tempfile.mkdtemp(prefix="dlaunch-bench-cache-")
        env = {**os.environ, "DLAUNCH_CACHE_DIR": cache}
        try:
            times["help"].append(timed([*DLAUNCH, "--help"], env))
            times["cold"].append(timed([*DLAUNCH, *PLAN], env))
            times["warm"].append(timed([*DLAUNCH, *PLAN], env))
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    load = os.getloadavg()[0]
    for name, values in times.items():
        print(f"{name:5s} median {statistics.median(values):.2f} s  "
              f"range {min(values):.2f}-{max(values):.2f} s  ({len(values)} runs)")
    print(f"load average at the end: {load:.2f}")


if __name__ == "__main__":
    main()

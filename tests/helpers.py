"""Helpers shared by the tests: run the real `dlaunch` CLI in a subprocess, as a user does; read
what a run left in its run directory; compare text with a golden file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.files import read_jsonl
from launcher.rundir import RECORDS, RunPaths

REPO = Path(__file__).resolve().parent.parent
WORKLOADS = REPO / "workloads"
DATA = Path(__file__).resolve().parent / "data"
GOLDEN = Path(__file__).resolve().parent / "golden"
UPDATE_GOLDEN_ENV = "DLAUNCH_UPDATE_GOLDEN"  # set to 1 to rewrite the golden files


@dataclass
class Done:
    """A finished dlaunch invocation."""

    code: int
    out: str
    err: str

    def json(self) -> dict:
        return json.loads(self.out)


def run_dlaunch(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
                timeout: float = 300, umask: int = -1) -> Done:
    """Run `python -m launcher.cli.main ARGS` and capture everything (`env` is added to this
    process's environment, without DLAUNCH_DEBUG; `umask` -1 keeps this process's)."""
    full_env = {**os.environ, **(env or {})}
    full_env.pop("DLAUNCH_DEBUG", None)
    proc = subprocess.run([sys.executable, "-m", "launcher.cli.main", *args], cwd=cwd or REPO,
                          env=full_env, capture_output=True, text=True, timeout=timeout,
                          umask=umask)
    return Done(proc.returncode, proc.stdout, proc.stderr)


def dlaunch_env(tmp: Path, *, own_cache: bool = False, **extra: str) -> dict[str, str]:
    """This process's environment for a dlaunch subprocess: TMPDIR `tmp`, one thread per rank,
    no DLAUNCH_DEBUG; `own_cache`: a cache of its own under `tmp` (`seeded_cache`); `extra` on
    top."""
    env = {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1", **extra}
    if own_cache:
        env["DLAUNCH_CACHE_DIR"] = str(seeded_cache(tmp / "cache"))
    env.pop("DLAUNCH_DEBUG", None)
    return env


_handed_out: list[Path] = []


def seeded_cache(cache: Path) -> Path:
    """`cache`, a dlaunch cache of its own holding what dlaunch measured in the suite's shared
    cache and in every cache this function handed out before in this process: the CPU and gloo
    probes, the profiles, the step timings. Each entry is keyed by what it measured, so one
    test's is every test's; corrections/ (what tune learns) and the locks stay each test's own.
    A test isolates what it changes, and the suite measures a host and a workload once, not
    4-12 s again in every test's first plan."""
    from launcher.plan import resolve  # the shared cache: where DLAUNCH_CACHE_DIR is unset

    if cache in _handed_out:  # a second launch of the same test: its cache is seeded already
        return cache
    root = resolve.cache_root()
    measured = [d().relative_to(root) for d in (resolve.probe_cache_dir, resolve.profile_cache_dir,
                                                 resolve.step_cache_dir)]
    for source in (root, *_handed_out):
        _copy_missing(source, cache, measured)
    cache.mkdir(parents=True, exist_ok=True)
    _handed_out.append(cache)
    return cache


def _copy_missing(src: Path, dst: Path, measured: list[Path]) -> None:
    """Each entry of cache `src`'s `measured` dirs that cache `dst` lacks (never a writer's .tmp file)."""
    for name in measured:
        for entry in (src / name).glob("[!.]*.json"):
            if not (dst / name / entry.name).exists():
                (dst / name).mkdir(parents=True, exist_ok=True)
                shutil.copy2(entry, dst / name / entry.name)


def start_dlaunch(argv: list[str], tmp: Path) -> subprocess.Popen[str]:
    """Start `python -m launcher.cli.main ARGV` (`dlaunch_env(tmp)`), stdout and stderr together
    in one text pipe."""
    env = dlaunch_env(tmp)
    return subprocess.Popen([sys.executable, "-m", "launcher.cli.main", *argv], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def run_dlaunch_together(runs: dict[str, tuple[list[str], Path]], tmp: Path,
                         timeout: float) -> dict[str, tuple[Path, int, str]]:
    """Start `dlaunch ARGV --run-dir DIR` for every name -> (argv, DIR) at once (one thread per
    rank, TMPDIR `tmp`; the workload's arguments after `--` stay last), wait for all, and return
    name -> (DIR, exit code, stdout + stderr)."""
    def argv_of(argv: list[str], run_dir: Path) -> list[str]:
        cut = argv.index("--") if "--" in argv else len(argv)
        return [*argv[:cut], "--run-dir", str(run_dir), *argv[cut:]]

    procs = {name: start_dlaunch(argv_of(*run), tmp) for name, run in runs.items()}
    out = {}
    for name, proc in procs.items():
        text, _ = proc.communicate(timeout=timeout)
        out[name] = (runs[name][1], proc.returncode, text)
    return out


def assert_one_line_error(done: Done, *needles: str) -> None:
    """Bad input: exit 2, one line on stderr, no traceback, every needle in the line."""
    assert done.code == 2, (done.code, done.out, done.err)
    lines = [line for line in done.err.splitlines() if line.strip()]
    assert len(lines) == 1, done.err
    assert "Traceback" not in done.err
    for n in needles:
        assert n in lines[0], (n, lines[0])


def assert_golden(name: str, text: str) -> None:
    """`text` equals tests/golden/NAME (rewritten first when DLAUNCH_UPDATE_GOLDEN is set)."""
    path = GOLDEN / name
    if os.environ.get(UPDATE_GOLDEN_ENV):
        path.write_text(text)
    assert text == path.read_text(), f"rendering differs from {path}; {UPDATE_GOLDEN_ENV}=1 rewrites it"


def rank_records(run_dir: Path, rank: int = 0) -> list[dict[str, Any]]:
    """Every record in rank `rank`'s rank file, in file order."""
    return read_jsonl(RunPaths(root=run_dir).records(rank))[0]


def step_losses(records: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """(step, loss) of each step record among `records`, in their order."""
    return [(r["step"], r["loss"]) for r in records if r["kind"] == "step"]


def rank_steps(run_dir: Path, rank: int = 0) -> list[tuple[int, float]]:
    """(step, loss) of each step record of rank `rank`, in file order."""
    return step_losses(rank_records(run_dir, rank))


def rank_losses(run_dir: Path, rank: int = 0) -> list[float]:
    """The loss of each step record of rank `rank`, in file order."""
    return [loss for _, loss in rank_steps(run_dir, rank)]


def log_tails(run_dir: Path, lines: int = 15) -> str:
    """The last lines of every submitit task log and torchrun rank stderr log of a run, for a
    failure message (pytest's tmp dirs rotate away)."""
    paths = RunPaths(root=run_dir)
    logs = sorted(paths.submitit.glob("*/*_log.err")) + sorted(paths.logs.glob("node-*/*/attempt_*/*/stderr.log"))
    return "".join(f"\n--- {log} ---\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
                   for log in logs)


def run_result(run_dir: Path) -> dict[str, Any]:
    """The run's result.json, as written."""
    return json.loads(RunPaths(root=run_dir).result.read_text())


def rank_pids(run_dir: Path) -> set[int]:
    """The PID of every rank process the run's rank files name, earlier attempts included."""
    paths = RunPaths(root=run_dir)
    dirs = [paths] + [RunPaths(root=d) for d in sorted(paths.attempts.glob("*")) if d.is_dir()]
    return {int(r["pid"]) for d in dirs for f in d.rank_files(RECORDS).values()
            for r in read_jsonl(f)[0] if r.get("kind") == "start" and r.get("pid")}


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")  # a zombie has ended; only its parent's wait is missing


def assert_processes_gone(pids: set[int], *, within_s: float = 10.0) -> None:
    """Every process in `pids` ends within `within_s` seconds (the test left nothing behind)."""
    deadline = time.monotonic() + within_s
    while (alive := sorted(p for p in pids if _alive(p))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive, f"processes left behind: {alive}"


def strict_json(text: str) -> Any:
    """Parse JSON as strict parsers do: bare NaN / Infinity are refused."""

    def refuse(name: str) -> Any:
        raise ValueError(f"bare {name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def published_runner() -> Any:
    """benchmarks/published/run.py as a module (it is a script, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("published_run", REPO / "benchmarks" / "published" / "run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module

"""A local run seen from outside: its state, its rank logs, and cancelling it, from its run dir.

A local run is owned by the dlaunch process that claimed its run dir (`owner.json`: pid, host,
time) and that process is the one to stop: on SIGTERM it stops torchrun and every rank, then
aggregates and writes `result.json` with status `interrupted` (launcher.backends.local and
launcher.drivers.launch). Killing the ranks directly would leave no summary.

The state, from the files alone:
  result.json              -> COMPLETED (status ok), CANCELLED (interrupted), FAILED (else)
  owner alive on this host -> RUNNING (with the rank steps of the heartbeats)
  owner on another host    -> UNKNOWN (its pid cannot be asked from here)
  otherwise                -> ORPHANED (dlaunch died without writing a result)

Never imports runtime, drivers, cli or results (it reads the files the ranks and dlaunch write).
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from launcher.backends.base import Cancelled, State
from launcher.backends.monitor import read_heartbeats, read_json_object
from launcher.backends.progress import clock
from launcher.errors import LaunchError, UsageError
from launcher.files import read_jsonl, read_new
from launcher.knobs import migrate
from launcher.procs import pid_alive
from launcher.rundir import LAUNCH_FILE, SLURM_FILE, RunPaths

CANCEL_WAIT_S = 30.0  # dlaunch's own stop takes STOP_GRACE_S (5 s) plus aggregating
POLL_S = 0.2
STALE_BEAT_S = 60.0  # a heartbeat older than this is worth mentioning (ranks beat every few s)

# result.json's status -> the run's state (any other status is a failure)
_RESULT_STATES = {"ok": State.COMPLETED, "interrupted": State.CANCELLED}


@dataclass(frozen=True, kw_only=True)
class LocalState:
    """A local run dir, read once."""

    run_dir: Path
    state: State
    reason: str
    pid: int | None = None  # the owning dlaunch
    host: str | None = None
    steps: Mapping[int, int] = field(default_factory=dict)  # rank -> step of its heartbeat
    beat_age_s: float | None = None  # since the newest heartbeat
    total_steps: int | None = None
    world_size: int | None = None
    result: Mapping[str, Any] | None = None  # result.json, when written
    step_s: float | None = None  # rank 0's seconds per step after warm-up (None: too few step records)


def run_dir_of(ref: str) -> Path:
    """The run dir `ref` names; one UsageError line when it is none."""
    path = Path(ref).expanduser()
    paths = RunPaths(root=path)
    if not path.is_dir() or not (paths.launch.is_file() or paths.owner.is_file()):
        raise UsageError(f"{ref!r} is not a run directory: not a SLURM run (no {SLURM_FILE}) nor a local one "
                         f"(no {LAUNCH_FILE}); give the run dir of a `dlaunch run` or a SLURM job id")
    return path.resolve()


def world_size(launch: Mapping[str, Any]) -> int | None:
    """Ranks of the run, from its launch.json (None when unreadable)."""
    current = migrate(launch)
    nodes, procs = current.get("nodes"), current.get("gpus")
    return nodes * procs if isinstance(nodes, int) and isinstance(procs, int) else None


def _step_s(paths: RunPaths, warmup: object) -> float | None:
    """Rank 0's seconds per step after warm-up from the end times its step records carry (the
    rank appends them at each logging window's end: they lag the heartbeat a little)."""
    try:
        records, _ = read_jsonl(paths.records(0))
    except OSError:
        return None
    w = warmup if isinstance(warmup, int) else 0
    ends = [(r["step"], r["end_time"]) for r in records
            if r.get("kind") == "step" and isinstance(r.get("end_time"), (int, float))
            and isinstance(r.get("step"), int) and r["step"] > w]
    if len(ends) < 2 or ends[-1][0] <= ends[0][0] or ends[-1][1] <= ends[0][1]:
        return None
    return (ends[-1][1] - ends[0][1]) / (ends[-1][0] - ends[0][0])


def read_state(run_dir: Path, *, now: Callable[[], float] = time.time) -> LocalState:
    """Where the local run in `run_dir` stands (see the module docstring)."""
    paths = RunPaths(root=run_dir)
    owner, launch = read_json_object(paths.owner), read_json_object(paths.launch)
    pid, host, since = owner.get("pid"), owner.get("host"), owner.get("time")
    beats = read_heartbeats(run_dir)
    steps = {r: b.step for r, b in beats.items()}
    age = now() - max(b.time for b in beats.values()) if beats else None
    common: dict[str, Any] = {
        "run_dir": run_dir, "pid": pid if isinstance(pid, int) else None,
        "host": host if isinstance(host, str) else None, "steps": steps, "beat_age_s": age,
        # a plain script runs its own loop: launch.json's steps is not its count
        "total_steps": None if launch.get("is_script") or not isinstance(launch.get("steps"), int) else launch["steps"],
        "world_size": world_size(launch), "step_s": _step_s(paths, launch.get("warmup_steps"))}
    result = read_json_object(paths.result) if paths.result.is_file() else None
    if result:
        status = str(result.get("status", "?"))
        failures = result.get("failures") or []
        why = str(failures[0]) if failures and isinstance(failures, list) else ""
        state = _RESULT_STATES.get(status, State.FAILED)
        if state is State.CANCELLED:  # e.g. exit 143: 128 + SIGTERM
            why = f"interrupted, exit {result.get('exit_code')}"
        reason = why or ("" if state is State.COMPLETED else f"result.json says {status}")
        return LocalState(state=state, reason=reason, result=result, **common)
    if common["pid"] is None:
        return LocalState(state=State.ORPHANED, reason="no owner in owner.json and no result.json", **common)
    if common["host"] != socket.gethostname():
        return LocalState(state=State.UNKNOWN, reason=f"run by dlaunch pid {pid} on host {host}; ask there", **common)
    alive = pid_alive(common["pid"], not_after=since if isinstance(since, (int, float)) else None)
    if not alive:
        return LocalState(state=State.ORPHANED, reason=f"dlaunch (pid {pid}) is gone and wrote no result.json",
                          **common)
    if age is None:
        reason = f"dlaunch pid {pid}; no rank heartbeat yet (starting)"
    elif age > STALE_BEAT_S:
        reason = f"dlaunch pid {pid}; no heartbeat for {age:.0f} s"
    else:
        reason = f"dlaunch pid {pid}; last heartbeat {age:.1f} s ago"
    return LocalState(state=State.RUNNING, reason=reason, **common)


def progress_line(st: LocalState) -> str:
    """`step 37/200 (per rank: 37 38), 0.21 s/step, ETA 0:34` (rate and ETA once rank 0 has
    written step records after warm-up), or '' before any rank beat."""
    if not st.steps:
        return ""
    ranks = range(st.world_size) if st.world_size else sorted(st.steps)
    done = min(st.steps.get(r, 0) for r in ranks)
    total = f"/{st.total_steps}" if st.total_steps is not None else ""
    line = f"step {done}{total} (per rank: {' '.join(str(st.steps.get(r, 0)) for r in ranks)})"
    if st.step_s is not None and st.total_steps is not None and st.state is State.RUNNING:
        line += f", {st.step_s:.3g} s/step, ETA {clock(st.step_s * max(0, st.total_steps - done))}"
    return line


def cancel(run_dir: Path, *, wait_s: float = CANCEL_WAIT_S) -> Cancelled:
    """SIGTERM the dlaunch that owns a RUNNING local run and wait until it has exited (a
    finished or gone run is left alone; one alive after `wait_s` is a LaunchError)."""
    st = read_state(run_dir)
    if st.state is State.UNKNOWN:
        raise LaunchError(f"{run_dir} is {st.reason}; cancel it on that host")
    if st.state is not State.RUNNING or st.pid is None:
        how = ": ".join(filter(None, (st.state.value, st.reason)))  # a completed run has no reason to give
        return Cancelled(before=st.state, after=st.state,
                         message=f"run {run_dir} already ended ({how}); nothing to cancel")
    t0 = time.monotonic()
    try:
        os.kill(st.pid, signal.SIGTERM)
    except ProcessLookupError:  # ended between the look and the signal
        pass
    except PermissionError:
        raise LaunchError(f"not allowed to signal dlaunch pid {st.pid} (another user's run?)") from None
    since = read_json_object(RunPaths(root=run_dir).owner).get("time")
    while pid_alive(st.pid, not_after=since if isinstance(since, (int, float)) else None):
        if time.monotonic() - t0 > wait_s:
            raise LaunchError(f"dlaunch pid {st.pid} is still running {wait_s:.0f} s after SIGTERM; "
                              f"check it with `ps -p {st.pid}` (kill -9 leaves no result.json)")
        time.sleep(POLL_S)
    after = read_state(run_dir)
    return Cancelled(before=st.state, after=after.state,
                     message=f"run {run_dir} cancelled: sent SIGTERM to dlaunch (pid {st.pid}), which stopped the "
                             f"job in {time.monotonic() - t0:.1f} s (now {after.state.value}"
                             + (f", {progress_line(st)} when cancelled" if st.steps else "") + ")")


def logs(run_dir: Path, *, out: IO[str], rank: int | None = None, follow: bool = False,
         poll_s: float = 0.5) -> None:
    """Print the ranks' log files (`==> file <==` before each, as tail does), or one rank's; `follow`
    prints whole new lines (`[rank N]` before each, unless one rank) until the run is not RUNNING."""
    paths = RunPaths(root=run_dir)
    world = world_size(read_json_object(paths.launch))
    if rank is not None and world is not None and rank >= world:
        raise UsageError(f"--rank {rank} is out of range: the run has ranks 0-{world - 1}")
    offsets: dict[Path, int] = {}

    def drain() -> None:
        # launch.json is read again each pass: a run followed while it starts has none yet
        ranks = [rank] if rank is not None else range(world_size(read_json_object(paths.launch)) or 0)
        for r in ranks:
            # torchrun's files of the rank, every attempt (one node: global rank = local rank)
            for path in paths.rank_logs(0, r, "stdout") + paths.rank_logs(0, r, "stderr"):
                text = read_new(path, offsets, whole_lines=follow)
                if not text:
                    continue
                if not follow and rank is None:
                    out.write(f"==> {path} <==\n")
                prefix = f"[rank {r}] " if follow and rank is None else ""
                for line in text.splitlines():
                    out.write(prefix + line + "\n")
        out.flush()

    drain()
    while follow:
        running = read_state(run_dir).state is State.RUNNING
        time.sleep(poll_s)
        drain()
        if not running:
            break

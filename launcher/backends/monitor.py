"""Watching a running job's ranks through their heartbeat files: hangs and silent exits.

Every rank replaces `RUN_DIR/rank-<r>.heartbeat` ({step, time, pid, host, stacks}) at least
every few seconds while it advances (see runtime.recorder; a plain script's bootstrap beats step 0
without a pid before its first step, runtime.bootstrap). `Watcher.poll()` turns those files
into a verdict, a `Stall`, when
  - no rank has advanced for `hang_timeout_s` (after every rank finished step 1; before that,
    `startup_timeout_s` from the launch covers imports, model build, compile and rendezvous), or
  - a rank on this host has exited without its summary while the job goes on (`os._exit(0)`:
    torchrun counts exit 0 as success and waits for the others, stuck in a collective).
It only reads files (and, for ranks on this host, asks the kernel whether their pid lives), so
the same watcher can run over a run dir on a shared file system (`check_pids=False`: the ranks
run on other hosts). The local backend runs `watch` in a thread beside torchrun; a backend with
a wait loop of its own calls `Watcher.poll()` there, then `postmortem.write_missing_summaries`.

Time is the watcher's own monotonic clock at which it *saw* a change, never the ranks' wall clocks:
nodes' clocks may disagree, and a rank that stops cannot lie about stopping. Never imports
launcher.runtime (it reads the ranks' heartbeat files), drivers, cli or report.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.files import atomic_write_json, read_json
from launcher.procs import pid_alive
from launcher.rundir import HEARTBEAT, RunPaths

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.5
# a rank gone without a summary: torchrun ends the job by itself on a non-zero exit within
# about a second; only if it is still running after this long did the rank exit with code 0
EXIT_GRACE_S = 3.0


@dataclass(frozen=True, kw_only=True)
class Beat:
    """One rank's heartbeat file."""

    rank: int
    step: int
    time: float  # the rank's wall clock when it beat
    pid: int | None = None
    host: str | None = None
    stacks: bool = False  # the rank dumps its stacks on SIGUSR1
    # beats with no step: a long call (RankRecorder.busy: a memory snapshot's dump), batches
    # fetched between steps (`alive`, a script's bootstrap before its first step); a changed
    # count is progress (the bootstrap's count gives way to its meter's, which starts again)
    busy_beats: int = 0


@dataclass(frozen=True, kw_only=True)
class Stall:
    """Why the watcher wants the job ended."""

    kind: str  # hang | exited | teardown
    message: str  # one line for the summary
    steps: dict[int, int]  # step each named rank reached (missing heartbeat: -1)
    ranks: tuple[int, ...]  # the ranks named: stopped advancing, or exited
    idle_s: float = 0.0


def read_heartbeats(run_dir: str | Path) -> dict[int, Beat]:
    """Every readable heartbeat in the run dir (a file being replaced is simply skipped)."""
    beats: dict[int, Beat] = {}
    for rank, path in RunPaths(root=run_dir).rank_files(HEARTBEAT).items():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            beats[rank] = Beat(rank=rank, step=int(data.get("step", 0)), time=float(data.get("time", 0.0)),
                               pid=data.get("pid"), host=data.get("host"), stacks=bool(data.get("stacks")),
                               busy_beats=int(data.get("busy_beats", 0)))
        except (OSError, ValueError, TypeError, AttributeError):
            continue
    return beats


@dataclass
class Watcher:
    """Polls heartbeats and summaries of `world_size` ranks; see the module docstring."""

    run_dir: Path
    world_size: int
    hang_timeout_s: float
    startup_timeout_s: float
    script: bool = False  # a plain script: one that steps no torch optimizer is never seen to advance
    check_pids: bool = True  # ranks on this host: notice one that left without a summary
    # True once torchrun has begun stopping the ranks itself (a rank failed): it then reports
    # every exit code, which says more than a pid that is gone
    torchrun_stopping: Callable[[], bool] = lambda: False
    clock: Callable[[], float] = time.monotonic
    _t0: float = field(init=False)
    _last_advance: float = field(init=False)
    _steps: dict[int, int] = field(init=False, default_factory=dict)
    _busy: dict[int, int] = field(init=False, default_factory=dict)
    _done: set[int] = field(init=False, default_factory=set)
    _gone_since: dict[int, float] = field(init=False, default_factory=dict)
    beats: dict[int, Beat] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)
        self._t0 = self._last_advance = self.clock()
        self._host = socket.gethostname()

    def poll(self) -> Stall | None:
        """Look once; a Stall when the job should be ended now."""
        now = self.clock()
        self.beats = beats = read_heartbeats(self.run_dir)
        for rank, beat in beats.items():
            if beat.step > self._steps.get(rank, -1):
                self._steps[rank] = beat.step
                self._last_advance = now
            if beat.busy_beats != self._busy.get(rank, 0):
                self._busy[rank] = beat.busy_beats
                self._last_advance = now
        done = {r for r in range(self.world_size) if RunPaths(root=self.run_dir).summary(r).exists()}
        if done - self._done:
            self._done |= done
            self._last_advance = now
        return self._exited_without_summary(now) or self._hang(now)

    def _exited_without_summary(self, now: float) -> Stall | None:
        if not self.check_pids or self.torchrun_stopping():
            return None
        for rank, beat in sorted(self.beats.items()):
            if rank in self._done or beat.pid is None or beat.host != self._host:
                continue
            if pid_alive(int(beat.pid), not_after=beat.time):
                self._gone_since.pop(rank, None)
                continue
            since = self._gone_since.setdefault(rank, now)
            if now - since >= EXIT_GRACE_S and not RunPaths(root=self.run_dir).summary(rank).exists():
                others = [r for r in range(self.world_size) if r != rank and r not in self._done]
                msg = f"rank {rank} exited without writing its summary after step {beat.step}"
                if others:
                    msg += f" while rank(s) {', '.join(map(str, others))} went on (torchrun waits for them)"
                return Stall(kind="exited", message=msg, steps={rank: beat.step}, ranks=(rank,))
        return None

    def _hang(self, now: float) -> Stall | None:
        if self.hang_timeout_s <= 0:
            return None
        idle = now - self._last_advance
        running = [r for r in range(self.world_size) if r not in self._done]
        if not running:
            # every rank said how it ended; torchrun should be gone within seconds
            if idle > self.hang_timeout_s:
                return Stall(kind="teardown", steps=dict(self._steps), ranks=(), idle_s=idle,
                             message=f"every rank finished but the job did not exit for {idle:.0f} s")
            return None
        if idle <= self.hang_timeout_s:
            return None
        started = all(r in self._done or self._steps.get(r, 0) >= 1 for r in range(self.world_size))
        if not started and now - self._t0 <= self.startup_timeout_s:
            return None
        steps = {r: self._steps.get(r, -1) for r in running}
        where = ", ".join(f"rank {r} at step {s}" if s >= 0 else f"rank {r} before its first heartbeat"
                          for r, s in steps.items())
        phase = "" if started else f" (still starting up after {now - self._t0:.0f} s)"
        if self.script and not any(self._steps.values()):
            where += "; a script that steps no torch optimizer never advances: --hang-timeout-s 0 leaves it unwatched"
        return Stall(kind="hang", steps=steps, ranks=tuple(running), idle_s=idle,
                     message=f"no rank advanced for {idle:.0f} s{phase}: {where}")


def watch(watcher: Watcher, *, running: Callable[[], bool], on_stall: Callable[[Stall], None],
          interval_s: float = POLL_INTERVAL_S, done: threading.Event | None = None) -> Stall | None:
    """Poll while `running()` and `done` is not set; call `on_stall` once with the first Stall and
    return it. Setting `done` ends the loop at once (a finished job must not wait for a poll)."""
    done = done or threading.Event()
    while running() and not done.is_set():
        stall = watcher.poll()
        if stall is not None:
            log.info("%s", stall.message)
            on_stall(stall)
            return stall
        done.wait(interval_s)
    return None


def host_pids(beats: dict[int, Beat]) -> dict[int, int]:
    """Ranks whose process runs on this host -> pid (what the local backend may signal)."""
    here = socket.gethostname()
    return {r: int(b.pid) for r, b in beats.items()
            if b.pid is not None and b.host == here and pid_alive(int(b.pid), not_after=b.time)}


def record_owner(paths: RunPaths, *, torchrun_pid: int) -> None:
    """Add the torchrun dlaunch started to the run dir's owner file (see `job_pids`)."""
    atomic_write_json(paths.owner, {**read_json_object(paths.owner), "torchrun_pid": torchrun_pid,
                                    "torchrun_started": time.time()})


def job_pids(run_dir: str | Path) -> dict[int, str]:
    """Processes of the run in `run_dir` still alive on this host: pid -> what it is. The dlaunch
    that claimed the dir and its torchrun (owner file), and every rank that wrote a heartbeat; a
    pid counts only if its process started before the file named it (never a recycled pid)."""
    paths = RunPaths(root=run_dir)
    owner = read_json_object(paths.owner)
    found: dict[int, str] = {}
    if owner.get("host") == socket.gethostname():
        for key, when, what in (("pid", "time", "dlaunch"), ("torchrun_pid", "torchrun_started", "torchrun")):
            pid, t = owner.get(key), owner.get(when)
            if isinstance(pid, int) and isinstance(t, (int, float)) and pid_alive(pid, not_after=t):
                found[pid] = what
    for rank, pid in host_pids(read_heartbeats(run_dir)).items():
        found.setdefault(pid, f"rank {rank}")
    found.pop(os.getpid(), None)  # this very dlaunch looking at a dir it ran before
    return found


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file that should hold an object; {} when it is missing, unreadable or not one."""
    try:
        data = read_json(path)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}

"""Run a job on this host with torchrun (`python -m torch.distributed.run`).

Rendezvous is c10d on 127.0.0.1 port 0: the store binds a free port itself, so two jobs started
at once cannot race for one. torchrun tees each rank's output into per-rank files and onto its
stdout with a `[rank N]` prefix; dlaunch shows those lines live, torchrun's own in `torchrun.log`.
`LocalBackend` (launcher.backends.host) wraps it. Never imports launcher.runtime (the ranks are
started by module name), results, report, drivers or cli.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import psutil

from launcher.backends.base import Ended, Evidence
from launcher.backends.keeper import LEFTOVER_PREFIX, keeper_argv, tie_to_parent
from launcher.backends.monitor import Beat, Stall, Watcher, host_pids, read_heartbeats, record_owner, watch
from launcher.backends.progress import LiveLine, Progress, ProgressSpec
from launcher.backends.stacks import STACK_WAIT_S, dump_stacks, name_straggler
from launcher.backends.torchrun import rank_env, torchrun_argv
from launcher.errors import LaunchError
from launcher.hardware.detect import usable_cores
from launcher.rundir import RunPaths
from launcher.runspec import LaunchSpec

log = logging.getLogger(__name__)

# seconds between SIGTERM and SIGKILL when dlaunch stops a job: a rank blocked in a collective
# never runs its SIGTERM handler, so waiting longer only delays the inevitable SIGKILL
STOP_GRACE_S = 5.0
HANG_EXIT_CODE = 124  # like timeout(1): the job was ended because it stopped advancing


@dataclass(frozen=True, kw_only=True)
class Rendered:
    """The exact command and the environment it adds, ready to print or run."""

    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str = "."


def render(spec: LaunchSpec, *, python: str | None = None, base_env: Mapping[str, str] | None = None,
           cores: int | None = None) -> Rendered:
    """The torchrun command for a single-node job, rendezvous on loopback."""
    if spec.nodes != 1:
        raise LaunchError(f"the local backend runs one node, got --nodes {spec.nodes}; use --slurm for several nodes")
    argv = torchrun_argv(spec, python=python or sys.executable, rdzv_endpoint="127.0.0.1:0",
                         log_dir=str(RunPaths(root=spec.run_dir).node_logs(0)))
    env = rank_env(spec, base_env=os.environ if base_env is None else base_env,
                   cores=usable_cores() if cores is None else cores)
    return Rendered(argv=tuple(argv), env=env, cwd=os.getcwd())


def say(console: IO[str], text: str) -> bool:
    """Write to the console; False when it has gone away (a closed pipe: `dlaunch run | head`).
    Console output is a courtesy: losing it must never stop the job's teardown or its logs."""
    try:
        console.write(text)
        console.flush()
        return True
    except (BrokenPipeError, ValueError, OSError):  # ValueError: the file was closed
        return False


# a tqdm bar's line after torchrun's prefix: " 33%|███▎      | 2/6 [00:00<00:00, 15.70it/s]"
# (a line with more after the bar, where another print joined it, is kept whole)
_BAR = re.compile(r"^\[rank \d+\] \s*(\d{1,3})%\|[^|]*\|\s*\d+/\d+(?: \[[^\]]*\])?\s*$")
BAR_EVERY_S = 10.0


class BarThrottle:
    """Which rank lines reach the console while a progress bar redraws (an HF Trainer's tqdm,
    whose every redraw torchrun turns into a line): a bar line at most every BAR_EVERY_S per
    rank, and its 100%; the blank lines of its redraws never. The rank log files keep all."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.last: dict[str, float] = {}

    def keep(self, line: str) -> bool:
        prefix, _, text = line.partition("] ")
        if not text.strip():
            return False
        bar = _BAR.match(line)
        if bar is None:
            return True
        now = self.clock()
        if bar.group(1) == "100" or now - self.last.get(prefix, -BAR_EVERY_S) >= BAR_EVERY_S:
            self.last[prefix] = now
            return True
        return False


def _pump(stream: IO[bytes], emit: Callable[[str], bool], torchrun_log: IO[str], debug: bool,
          stopping: threading.Event, leftovers: list[str]) -> None:
    """Send rank lines to the console (`emit`: False once it has gone); torchrun's own lines to its
    log (and the console if debug); the keeper's line on processes the job left running to both,
    and into `leftovers`. Sets `stopping` when torchrun says it stops the ranks (one failed). Reads
    to the end even once the console has gone: torchrun would block on a full pipe otherwise."""
    shown = True
    bars = BarThrottle()
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace")
        if line.startswith("[rank "):
            if bars.keep(line):
                shown = shown and emit(line)
            continue
        if "closing signal" in line:
            stopping.set()
        torchrun_log.write(line)
        torchrun_log.flush()
        if line.startswith(LEFTOVER_PREFIX):
            leftovers.append(line.strip().removeprefix("dlaunch: "))
        if debug or line.startswith(LEFTOVER_PREFIX):
            shown = shown and emit(line)


def launch(rendered: Rendered, spec: LaunchSpec, *, console: IO[str] = sys.stdout, debug: bool = False,
           extra_env: Mapping[str, str] | None = None, attempt: int = 0,
           progress: ProgressSpec | None = None) -> Ended:
    """Run the rendered command to completion while watching the ranks' heartbeats: the watcher
    (launcher.backends.monitor) ends the job when no rank advanced for `spec.hang_timeout_s` or a
    rank left without a summary while torchrun waits for it. Ctrl-C / SIGTERM / SIGHUP stop the
    whole job (torchrun and every rank) and come back as `Ended.interrupted`; torchrun dies with
    dlaunch (`launcher.backends.keeper`). `progress`: the live progress line's measure."""
    paths = RunPaths(root=spec.run_dir)
    # never world-writable, whatever the user's umask: torchrun and the ranks create the logs
    umask = os.umask(0o022)
    os.umask(umask)
    # 0640 whatever the umask (open() would make it 0666 under umask 000)
    fd = os.open(paths.torchrun_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
    job: dict[str, Any] = {}  # proc, stall, stacks, interrupted: shared with the threads
    watcher = Watcher(run_dir=Path(spec.run_dir), world_size=spec.world_size, hang_timeout_s=spec.hang_timeout_s,
                      startup_timeout_s=spec.startup_timeout_s, script=spec.is_script)
    # from before torchrun exists: a Ctrl-C while it starts must stop it too
    restore = _catch_interrupts(job, watcher)
    # backslashreplace: a run dir or argument may hold any bytes the OS allows (not UTF-8)
    with os.fdopen(fd, "a", encoding="utf-8", errors="backslashreplace") as tlog:
        offset = tlog.tell()
        tlog.write(f"=== dlaunch attempt {attempt}: {shlex.join(rendered.argv)}\n")
        tlog.flush()
        try:
            try:
                # torchrun under a one-threaded keeper: dlaunch's death reaches it once
                proc = subprocess.Popen(keeper_argv(sys.executable, rendered.argv), cwd=rendered.cwd,
                                        env={**os.environ, **rendered.env, **(extra_env or {})},
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=True, preexec_fn=tie_to_parent(signal.SIGKILL),
                                        umask=umask | 0o002)
            except OSError as e:
                raise LaunchError(f"cannot start {rendered.argv[0]!r}: {e.strerror}") from None
            job["proc"] = proc
            record_owner(paths, torchrun_pid=proc.pid)
            if "interrupted" in job:
                stop_job(proc, watcher.beats)
            code = _follow(proc, spec, console, tlog, debug, watcher, job, progress)
        finally:
            restore()
    beats = read_heartbeats(spec.run_dir) or watcher.beats
    stall = job.get("stall")
    if stall is not None:
        # dlaunch stopped the job: torchrun's code only says that it was told to stop
        code = HANG_EXIT_CODE if stall.kind == "hang" else 1
    elif code < 0:
        code = 128 - code  # killed by a signal: the shell's convention, never a negative status
    with open(paths.torchrun_log, encoding="utf-8", errors="replace") as f:
        f.seek(offset)
        text = f.read()
    return Ended(exit_code=code, stall=stall, interrupted=job.get("interrupted"), restartable=True,
                 warnings=tuple(job.get("warnings", ())),
                 evidence=Evidence(beats=beats, stacks=job.get("stacks", {}), torchrun_log=text))


def _follow(proc: subprocess.Popen[bytes], spec: LaunchSpec, console: IO[str], tlog: IO[str], debug: bool,
            watcher: Watcher, job: dict[str, Any], progress: ProgressSpec | None) -> int:
    """Pump torchrun's output and watch the ranks until torchrun exits; its exit code."""
    stopping = threading.Event()
    watcher.torchrun_stopping = stopping.is_set
    live = None if progress is None else LiveLine(
        Progress(spec=progress, start_s=time.monotonic()), console, beats=lambda: dict(watcher.beats), write=say,
        locate=lambda: name_straggler(spec.run_dir, dict(watcher.beats)))
    emit: Callable[[str], bool] = (lambda text: say(console, text)) if live is None else live.above
    leftovers: list[str] = []
    pump = threading.Thread(target=_pump, args=(proc.stdout, emit, tlog, debug, stopping, leftovers), daemon=True)
    pump.start()
    if live is not None:
        live.start()

    def on_stall(stall: Stall) -> None:
        job["stall"] = stall
        if stall.kind == "hang":
            # before stopping anything: which rank is in its own code, which wait in torch
            job["stacks"] = dump_stacks(spec.run_dir, watcher.beats)
        say(console, f"dlaunch: {stall.message}; stopping the job\n")
        stop_job(proc, watcher.beats)

    exited = threading.Event()
    watch_thread = threading.Thread(target=watch, args=(watcher,), daemon=True, kwargs={
        "running": lambda: proc.poll() is None and "interrupted" not in job, "on_stall": on_stall, "done": exited})
    watch_thread.start()
    try:
        return proc.wait()
    finally:
        exited.set()
        watch_thread.join(timeout=STOP_GRACE_S + STACK_WAIT_S + 5)
        pump.join(timeout=5)
        if live is not None:
            live.stop()
        job["warnings"] = (*(live.progress.warnings if live is not None else ()), *leftovers)


def stop_job(proc: subprocess.Popen[bytes], beats: Mapping[int, Beat] | None = None, *,
             grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM torchrun and every rank, then SIGKILL whatever is left after `grace_s`. torchrun
    starts each rank in a session of its own, so signalling its process group does not reach
    them, and a rank blocked in a collective never runs its Python SIGTERM handler: so every
    process of the job is signalled by pid (torchrun's descendants, and the ranks that wrote a
    heartbeat on this host). torchrun hears it once, from its keeper (`proc`): a second SIGTERM
    inside torchrun's shutdown can abandon it (see `launcher.backends.keeper`)."""
    victims: dict[int, psutil.Process] = {}
    passed_on: set[int] = set()  # torchrun: its keeper (the root) passes the SIGTERM on, once
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(proc.pid)
        passed_on = {p.pid for p in root.children()}
        victims = {p.pid: p for p in [root, *root.children(recursive=True)]}
    for pid in host_pids(dict(beats or {})).values():
        with contextlib.suppress(psutil.NoSuchProcess):
            victims.setdefault(pid, psutil.Process(pid))
    _signal_all([p for p in victims.values() if p.pid not in passed_on], signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_running(p) for p in victims.values()):
        time.sleep(0.1)
    left = [p for p in victims.values() if _running(p)]
    if left:
        log.warning("SIGKILL to %d process(es) still running %.0f s after SIGTERM", len(left), grace_s)
        _signal_all(left, signal.SIGKILL)


def _running(p: Any) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _signal_all(procs: Any, sig: int) -> None:
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            p.send_signal(sig)


def _catch_interrupts(job: dict[str, Any], watcher: Watcher) -> Callable[[], None]:
    """On SIGINT/SIGTERM/SIGHUP note the signal in `job` and stop the job (if started); returns what
    restores the handlers. An ignored SIGHUP stays ignored (`nohup dlaunch run` outlives its terminal)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def relay(signum: int, frame: object) -> None:
        job.setdefault("interrupted", signum)
        if "proc" in job:
            stop_job(job["proc"], watcher.beats)

    sigs = [signal.SIGINT, signal.SIGTERM]
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        sigs.append(signal.SIGHUP)
    old = {s: signal.signal(s, relay) for s in sigs}

    def restore() -> None:
        for s, h in old.items():
            signal.signal(s, h)

    return restore

"""Run a job on this host with torchrun (`python -m torch.distributed.run`).

Rendezvous is c10d on 127.0.0.1 port 0: the store binds a free port itself, so two jobs
started at the same moment cannot race for one. Each rank's stdout and stderr are teed by
torchrun into per-rank files and onto its stdout with a `[rank N]` prefix; the launcher reads
that stream and shows rank lines live, keeping torchrun's own chatter in `torchrun.log`.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from launcher.backends import RANK_ENTRY_MODULE
from launcher.backends.monitor import Beat, Stall, Watcher, host_pids, read_heartbeats, watch
from launcher.backends.postmortem import STACK_WAIT_S, StackInfo, dump_stacks
from launcher.errors import LaunchError
from launcher.specs import LaunchSpec

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
LINE_PREFIX = "[rank ${rank}] "
LAUNCH_FILE = "launch.json"
# seconds between SIGTERM and SIGKILL when dlaunch stops a job: a rank blocked in a collective
# never runs its SIGTERM handler, so waiting longer only delays the inevitable SIGKILL
STOP_GRACE_S = 5.0
CHECKPOINT_SUBDIR = "checkpoints"  # as in backends.slurm_task
HANG_EXIT_CODE = 124  # like timeout(1): the job was ended because it stopped advancing


@dataclass(frozen=True, kw_only=True)
class Rendered:
    """The exact command and the environment it adds, ready to print or run."""

    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str = "."

    def shell_line(self) -> str:
        """A copy-pasteable rendering (quoted for a POSIX shell)."""
        import shlex

        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return f"{env} {shlex.join(self.argv)}".strip()


def usable_cores() -> int:
    """CPU cores this process may run on (affinity-aware)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def rank_env(spec: LaunchSpec, *, base_env: Mapping[str, str], cores: int) -> dict[str, str]:
    """The variables dlaunch adds for the ranks (the user's own settings win)."""
    env: dict[str, str] = {
        "DLAUNCH_RUN_DIR": spec.run_dir,
        "DLAUNCH_RUN_ID": spec.run_id,
        "DLAUNCH_WARMUP_STEPS": str(spec.warmup_steps),
        "PYTHONUNBUFFERED": "1",
        "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": LINE_PREFIX,
        # the package may be used from a checkout without being installed
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), base_env.get("PYTHONPATH", "")) if p),
    }
    if "OMP_NUM_THREADS" not in base_env:
        # ranks that each take every core fight for them (4.3x slower measured on 2 cores)
        env["OMP_NUM_THREADS"] = str(max(1, cores // spec.nproc_per_node))
    if spec.device == "cuda" and "PYTORCH_CUDA_ALLOC_CONF" not in base_env:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if spec.max_restarts > 0 or spec.checkpoint_every > 0:
        # where the harness saves and, on a restart (DLAUNCH_RESUME=1), resumes from
        # (runtime.resume); the same variable the SLURM backend sets
        env["DLAUNCH_CHECKPOINT_DIR"] = str(Path(spec.run_dir) / CHECKPOINT_SUBDIR)
    for k, v in spec.env.items():
        env.setdefault(k, v)
    return env


def node_log_dir(run_dir: str, node_rank: int) -> str:
    """Where torchrun on node `node_rank` keeps its ranks' log files."""
    return str(Path(run_dir) / "logs" / f"node-{node_rank}")


def torchrun_argv(spec: LaunchSpec, *, python: str, rdzv_endpoint: str, node_rank: int = 0,
                  log_dir: str) -> list[str]:
    """The torchrun command line shared by the local and the SLURM backend."""
    argv = [
        python, "-m", "torch.distributed.run",
        "--nnodes", str(spec.num_nodes),
        "--nproc-per-node", str(spec.nproc_per_node),
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", rdzv_endpoint,
        "--rdzv-id", spec.run_id,
        "--max-restarts", "0",
        "--log-dir", log_dir,
        "--tee", "3",
    ]
    if spec.num_nodes > 1:
        argv += ["--node-rank", str(node_rank)]
    if spec.is_script:
        argv += [spec.workload, *spec.workload_args]
    else:
        argv += ["-m", RANK_ENTRY_MODULE, str(Path(spec.run_dir) / LAUNCH_FILE)]
    return argv


def render(spec: LaunchSpec, *, python: str | None = None,
           base_env: Mapping[str, str] | None = None, cores: int | None = None) -> Rendered:
    """The torchrun command for a single-node job, rendezvous on loopback."""
    if spec.num_nodes != 1:
        raise LaunchError(f"the local backend runs one node, got --nodes {spec.num_nodes}; "
                          "use --slurm for several nodes")
    argv = torchrun_argv(spec, python=python or sys.executable, rdzv_endpoint="127.0.0.1:0",
                         log_dir=node_log_dir(spec.run_dir, 0))
    env = rank_env(spec, base_env=os.environ if base_env is None else base_env,
                   cores=usable_cores() if cores is None else cores)
    return Rendered(argv=tuple(argv), env=env, cwd=os.getcwd())


def _pump(stream: IO[bytes], console: IO[str], torchrun_log: IO[str], debug: bool,
          stopping: threading.Event | None = None) -> None:
    """Send rank lines to the console; torchrun's own lines to its log (and console if debug).

    `stopping` is set when torchrun says it is stopping the ranks (one of them failed).
    """
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace")
        if line.startswith("[rank "):
            console.write(line)
            console.flush()
        else:
            if stopping is not None and "closing signal" in line:
                stopping.set()
            torchrun_log.write(line)
            torchrun_log.flush()
            if debug:
                console.write(line)
                console.flush()


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """How a torchrun invocation ended."""

    exit_code: int  # torchrun's, or 128 + signal; HANG_EXIT_CODE when dlaunch ended a hang
    stall: Stall | None = None  # why dlaunch ended the job, if it did
    stacks: Mapping[int, StackInfo] = field(default_factory=dict)
    beats: Mapping[int, Beat] = field(default_factory=dict)  # the last heartbeats seen
    torchrun_log: str = ""  # what torchrun said during this attempt


def launch(rendered: Rendered, spec: LaunchSpec, *, console: IO[str] = sys.stdout,
           debug: bool = False, extra_env: Mapping[str, str] | None = None,
           attempt: int = 0) -> Outcome:
    """Run the rendered command to completion while watching the ranks' heartbeats.

    The watcher (launcher.backends.monitor) ends the job when no rank advances for
    `spec.hang_timeout_s` or a rank leaves without a summary while torchrun waits for it.
    Ctrl-C / SIGTERM stop the whole job the same way: torchrun and every rank.
    """
    env = {**os.environ, **rendered.env, **(extra_env or {})}
    log_path = Path(spec.run_dir) / "torchrun.log"
    # never world-writable, whatever the user's umask: torchrun and the ranks create the logs
    umask = os.umask(0o022)
    os.umask(umask)
    # 0640 whatever the umask (open() would make it 0666 under umask 000)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
    with os.fdopen(fd, "a", encoding="utf-8") as tlog:
        offset = tlog.tell()
        tlog.write(f"=== dlaunch attempt {attempt}: {' '.join(rendered.argv)}\n")
        tlog.flush()
        try:
            proc = subprocess.Popen(list(rendered.argv), env=env, cwd=rendered.cwd,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    umask=umask | 0o002)
        except OSError as e:
            raise LaunchError(f"cannot start {rendered.argv[0]!r}: {e.strerror}") from None
        stopping = threading.Event()
        pump = threading.Thread(target=_pump, args=(proc.stdout, console, tlog, debug, stopping),
                                daemon=True)
        pump.start()
        watcher = Watcher(run_dir=Path(spec.run_dir), world_size=spec.world_size,
                          hang_timeout_s=spec.hang_timeout_s,
                          startup_timeout_s=spec.startup_timeout_s,
                          expect_heartbeats=not spec.is_script, torchrun_stopping=stopping.is_set)
        found: dict[str, Any] = {}

        def on_stall(stall: Stall) -> None:
            found["stall"] = stall
            if stall.kind == "hang":
                # before stopping anything: which rank is in its own code, which wait in torch
                found["stacks"] = dump_stacks(spec.run_dir, watcher.beats)
            print(f"dlaunch: {stall.message}; stopping the job", file=console, flush=True)
            stop_job(proc, watcher.beats)

        watch_thread = threading.Thread(
            target=watch, args=(watcher,),
            kwargs={"running": lambda: proc.poll() is None, "on_stall": on_stall}, daemon=True)
        watch_thread.start()
        stop = _forward_signals(proc, watcher)
        try:
            code = proc.wait()
        finally:
            stop()
            watch_thread.join(timeout=STOP_GRACE_S + STACK_WAIT_S + 5)
            pump.join(timeout=5)
    beats = read_heartbeats(spec.run_dir) or watcher.beats
    stall = found.get("stall")
    if stall is not None:
        # dlaunch stopped the job: torchrun's code only says that it was told to stop
        code = HANG_EXIT_CODE if stall.kind == "hang" else 1
    elif code < 0:
        code = 128 - code  # killed by a signal: the shell's convention, never a negative status
    with open(log_path, encoding="utf-8", errors="replace") as f:
        f.seek(offset)
        text = f.read()
    return Outcome(exit_code=code, stall=stall, stacks=found.get("stacks", {}), beats=beats,
                   torchrun_log=text)


def stop_job(proc: subprocess.Popen[bytes], beats: Mapping[int, Beat] | None = None, *,
             grace_s: float | None = None) -> None:
    """SIGTERM torchrun and every rank, then SIGKILL whatever is left after `grace_s`.

    torchrun starts each rank in a session of its own, so signalling torchrun's process group
    does not reach them; and a rank blocked inside a collective never runs its Python SIGTERM
    handler. So every process of the job is signalled by pid: torchrun's descendants (found
    through /proc) plus the ranks that wrote a heartbeat on this host.
    """
    import psutil

    grace = STOP_GRACE_S if grace_s is None else grace_s
    victims: dict[int, psutil.Process] = {}
    try:
        root = psutil.Process(proc.pid)
        for p in [root, *root.children(recursive=True)]:
            victims[p.pid] = p
    except psutil.NoSuchProcess:
        pass
    for pid in host_pids(dict(beats or {})).values():
        try:
            victims.setdefault(pid, psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _signal_all(victims.values(), signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_running(p) for p in victims.values()):
        time.sleep(0.1)
    left = [p for p in victims.values() if _running(p)]
    if left:
        log.warning("SIGKILL to %d process(es) still running %.0f s after SIGTERM", len(left), grace)
        _signal_all(left, signal.SIGKILL)


def _running(p: Any) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _signal_all(procs: Any, sig: int) -> None:
    import psutil

    for p in procs:
        try:
            p.send_signal(sig)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


def _forward_signals(proc: subprocess.Popen[bytes], watcher: Watcher) -> Callable[[], None]:
    """Stop the whole job on SIGINT/SIGTERM; returns a function that restores the handlers."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def relay(signum: int, frame: object) -> None:
        stop_job(proc, watcher.beats)

    old = {s: signal.signal(s, relay) for s in (signal.SIGINT, signal.SIGTERM)}

    def restore() -> None:
        for s, h in old.items():
            signal.signal(s, h)

    return restore

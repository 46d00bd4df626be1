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
from typing import IO

from launcher.backends import RANK_ENTRY_MODULE
from launcher.errors import LaunchError
from launcher.specs import LaunchSpec

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
LINE_PREFIX = "[rank ${rank}] "
LAUNCH_FILE = "launch.json"


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


def _pump(stream: IO[bytes], console: IO[str], torchrun_log: IO[str], debug: bool) -> None:
    """Send rank lines to the console; torchrun's own lines to its log (and console if debug)."""
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace")
        if line.startswith("[rank "):
            console.write(line)
            console.flush()
        else:
            torchrun_log.write(line)
            torchrun_log.flush()
            if debug:
                console.write(line)
                console.flush()


def launch(rendered: Rendered, spec: LaunchSpec, *, console: IO[str] = sys.stdout,
           debug: bool = False) -> int:
    """Run the rendered command to completion; returns torchrun's exit code.

    Ctrl-C / SIGTERM are passed on to the whole torchrun process group, which stops the ranks.
    """
    env = {**os.environ, **rendered.env}
    log_path = Path(spec.run_dir) / "torchrun.log"
    with open(log_path, "a", encoding="utf-8") as tlog:
        try:
            proc = subprocess.Popen(list(rendered.argv), env=env, cwd=rendered.cwd,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as e:
            raise LaunchError(f"cannot start {rendered.argv[0]!r}: {e.strerror}") from None
        pump = threading.Thread(target=_pump, args=(proc.stdout, console, tlog, debug), daemon=True)
        pump.start()
        stop = _forward_signals(proc)
        try:
            code = proc.wait()
        finally:
            stop()
            pump.join(timeout=5)
    return code


def _forward_signals(proc: subprocess.Popen[bytes]) -> Callable[[], None]:
    """Relay SIGINT/SIGTERM to the job's process group; returns a function that restores."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def relay(signum: int, frame: object) -> None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        # torchrun stops its ranks on SIGTERM; give it a moment, then make sure
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)

    old = {s: signal.signal(s, relay) for s in (signal.SIGINT, signal.SIGTERM)}

    def restore() -> None:
        for s, h in old.items():
            signal.signal(s, h)

    return restore

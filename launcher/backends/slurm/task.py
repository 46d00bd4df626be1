"""What runs inside a SLURM job: one `NodeTask` per node, each starting one torchrun.

submitit pickles a `NodeTask` and srun starts one copy per node (tasks_per_node=1). Each copy
works out where it is from SLURM's environment — node rank from SLURM_NODEID, the rendezvous
host as the first name of SLURM_JOB_NODELIST, a port derived from the job id — and runs the
same torchrun command the local backend uses. Kept free of torch and of `launcher.runtime`.

Preemption and requeue (see `checkpoint`): SLURM signals every process of the step with the
preemption signal (USR2, 90 s before the time limit, or `scancel --signal USR2`). torchrun would
die of it, orphaning its ranks, so it is started with USR2 ignored; a rank that checkpoints on
preemption installs its own handler. On a requeued start SLURM_RESTART_COUNT > 0 and the ranks
are told to resume from their last checkpoint (DLAUNCH_RESUME=1).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from launcher.backends.torchrun import rank_env, torchrun_argv
from launcher.files import atomic_write_json
from launcher.rundir import CHECKPOINT_DIR_ENV, NODE_FILE, RunPaths, checkpoint_dir
from launcher.runspec import LaunchSpec

if TYPE_CHECKING:
    from submitit.helpers import DelayedSubmission

PORT_BASE = 20000
PORT_SPAN = 20000
# seconds a preempted task waits for its ranks to save and exit before the job is requeued
# (the signal comes signal_delay_s = 90 s before SLURM kills the job; keep a margin);
# DLAUNCH_PREEMPT_GRACE_S in the submitting environment overrides it
PREEMPT_GRACE_S = 60.0


def rdzv_port(job_id: int) -> int:
    """The c10d store port of a job: derived from its id, so concurrent jobs that share a head
    node do not collide (a fixed port would: the classic torchrun-under-SLURM failure)."""
    return PORT_BASE + job_id % PORT_SPAN


def node_argv(spec: LaunchSpec, *, python: str, head: str, port: int | str, node_rank: int | str) -> list[str]:
    """The torchrun command of one node (`port`/`node_rank` may be placeholders for printing)."""
    return torchrun_argv(spec, python=python, rdzv_endpoint=f"{head}:{port}",
                         node_rank=node_rank,  # type: ignore[arg-type]  # placeholder when printing
                         log_dir=str(RunPaths(root=spec.run_dir).node_logs(node_rank)))


def slurm_run_env(spec: LaunchSpec, *, restart_count: int, resume: bool) -> dict[str, str]:
    """Variables the ranks get on top of `rank_env` under SLURM (what the harness reads)."""
    env = {CHECKPOINT_DIR_ENV: str(checkpoint_dir(spec.run_dir, os.environ)),
           "DLAUNCH_SLURM_RESTART_COUNT": str(restart_count)}
    if resume or restart_count > 0:
        env["DLAUNCH_RESUME"] = "1"
    return env


def _cores_here(default: int) -> int:
    """CPUs SLURM gave this task (one task per node, so the node's share of the job)."""
    for key in ("SLURM_CPUS_PER_TASK", "SLURM_CPUS_ON_NODE"):
        value = os.environ.get(key, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return default


def _ignore_preempt_signal() -> None:
    # runs in the child between fork and exec: an ignored signal stays ignored across exec
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


class NodeTask:
    """The callable submitit runs once per node. Checkpointable: submitit calls `checkpoint`
    on the preemption signal and requeues the job with what it returns."""

    def __init__(self, spec: LaunchSpec, *, python: str, cpus_per_node: int | None, resume: bool = False) -> None:
        self.spec, self.python, self.cpus_per_node, self.resume = spec, python, cpus_per_node, resume
        self._proc: subprocess.Popen[bytes] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_proc"] = None  # a running process does not travel through a pickle
        return state

    def command(self, environ: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
        """The torchrun argv and the full environment for this node, from SLURM's variables."""
        import submitit  # deferred: the launcher imports this module without submitting

        job_env = submitit.JobEnvironment()
        job_id = int(job_env.raw_job_id)
        head = job_env.hostnames[0]  # first node of SLURM_JOB_NODELIST hosts the c10d store
        node_rank = job_env.node
        restarts = int(environ.get("SLURM_RESTART_COUNT", "0") or 0)
        argv = node_argv(self.spec, python=self.python, head=head, port=rdzv_port(job_id), node_rank=node_rank)
        cores = _cores_here(self.cpus_per_node or os.cpu_count() or 1)
        env = {**environ, **rank_env(self.spec, base_env=environ, cores=cores),
               **slurm_run_env(self.spec, restart_count=restarts, resume=self.resume),
               # c10d assigns GROUP_RANK in its own order (sorted host name, pid), not
               # SLURM_NODEID's; this is the node rank the log dir is named after
               "DLAUNCH_NODE_RANK": str(node_rank)}
        return argv, env

    def __call__(self) -> dict[str, Any]:
        argv, env = self.command(os.environ)
        node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        node_rank = os.environ.get("SLURM_NODEID", "0")
        print(f"dlaunch: node {node_rank} ({node}): {' '.join(argv)}", flush=True)
        log_dir = str(RunPaths(root=self.spec.run_dir).node_logs(int(node_rank)))
        os.makedirs(log_dir, exist_ok=True)
        atomic_write_json(os.path.join(log_dir, NODE_FILE), {
            "slurm_node_id": int(node_rank), "host": node, "job_id": os.environ.get("SLURM_JOB_ID"),
            "restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)})
        self._proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, preexec_fn=_ignore_preempt_signal)
        code = self._proc.wait()
        if code != 0:
            # the exception text lands in submitit's result pickle and the task's .err log
            raise RuntimeError(f"torchrun on node {node_rank} ({node}) exited with code {code}")
        return {"node_rank": int(node_rank), "host": node, "exit_code": code}

    def checkpoint(self, *args: Any, **kwargs: Any) -> DelayedSubmission:
        """Preempted or timed out: let the ranks finish saving, then hand back the requeued call.
        The ranks got the signal from SLURM directly; a harness that checkpoints on it saves and
        exits. Waiting for torchrun here keeps `scontrol requeue` (which submitit runs right after
        this returns) from killing a half-written checkpoint; a harness that ignores the signal
        resumes from its last periodic checkpoint."""
        import submitit  # deferred: the launcher imports this module without submitting

        proc = self._proc
        if proc is not None and proc.poll() is None:
            grace = float(os.environ.get("DLAUNCH_PREEMPT_GRACE_S", PREEMPT_GRACE_S))
            deadline = time.monotonic() + grace
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            if proc.poll() is None:
                print("dlaunch: ranks still running after the preemption grace period; "
                      "stopping torchrun", file=sys.stderr, flush=True)
                proc.terminate()
        requeued = NodeTask(self.spec, python=self.python, cpus_per_node=self.cpus_per_node, resume=True)
        return submitit.helpers.DelayedSubmission(requeued)

"""A SLURM run seen from outside, by run dir or job id: its job, its logs, cancelling it.

What `dlaunch logs|cancel RUN_DIR_OR_JOB` do for a SLURM run (and the job lookup `status`
starts from); the summary `status` prints once the job is over needs the results code, so it
is composed in launcher.jobs.slurm (`SlurmBackend.status`).

Never imports launcher.runtime, jobs, cli or report, nor submitit.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from launcher.backends.base import Cancelled, State
from launcher.backends.slurm.jobs import JobInfo, cancel_job, in_queue, query_job, read_slurm_file, resolve, task_logs
from launcher.errors import LaunchError, UsageError
from launcher.files import read_new
from launcher.rundir import SLURM_FILE, RunPaths
from launcher.specs import LaunchSpec

CANCEL_WAIT_S = 30.0
FOLLOW_POLL_S = 0.5

# SLURM's base job states -> the backend-neutral State (anything else: UNKNOWN)
_STATES = {
    "PENDING": State.PENDING, "REQUEUED": State.PENDING, "CONFIGURING": State.PENDING,
    "RUNNING": State.RUNNING, "COMPLETING": State.RUNNING, "SUSPENDED": State.RUNNING,
    "COMPLETED": State.COMPLETED, "CANCELLED": State.CANCELLED, "PREEMPTED": State.CANCELLED,
    "FAILED": State.FAILED, "TIMEOUT": State.FAILED, "NODE_FAIL": State.FAILED,
    "OUT_OF_MEMORY": State.FAILED, "BOOT_FAIL": State.FAILED, "DEADLINE": State.FAILED,
    "REVOKED": State.FAILED,
}


def state_of(info: JobInfo) -> State:
    """The neutral state of a SLURM job."""
    return _STATES.get(info.state, State.UNKNOWN)


def claims(ref: str) -> bool:
    """A run dir with slurm.json, or a bare job id (files only: no SLURM command runs)."""
    path = Path(ref).expanduser()
    if path.is_dir():
        return (path / SLURM_FILE).is_file()
    return ref.isdigit()


def job(ref: str) -> tuple[Path | None, str, JobInfo]:
    """(run dir or None, job id, the job now); a job SLURM does not know is a LaunchError."""
    run_dir, job_id = resolve(ref)
    info = query_job(job_id)
    if info is None:
        raise LaunchError(f"SLURM knows no job {job_id} (purged from accounting, or another cluster)")
    return run_dir, job_id, info


def launch_spec(run_dir: Path) -> LaunchSpec:
    """The run's launch.json."""
    return LaunchSpec.from_dict(json.loads(RunPaths(root=run_dir).launch.read_text(encoding="utf-8")))


def _rank_filter(rank: int | None) -> Callable[[str], bool]:
    prefix = f"[rank {rank}] " if rank is not None else ""
    return lambda line: line.startswith(prefix)


def logs(ref: str, *, rank: int | None = None, follow: bool = False, out: IO[str]) -> None:
    """Print the job's per-node task logs (torchrun's and every rank's lines), or one rank's.

    Rank lines carry torchrun's `[rank N]` prefix (local backend's LINE_PREFIX), which is what
    `--rank` selects. `--follow` keeps printing new lines until the job is over.
    """
    run_dir, job_id = resolve(ref)
    if run_dir is None:
        raise LaunchError(f"job {job_id} was not started by `dlaunch run --slurm` here "
                          "(no run dir found); its logs are where its sbatch --output points")
    folder = Path(read_slurm_file(run_dir)["submitit_folder"])
    if rank is not None:
        spec = launch_spec(run_dir)
        if rank >= spec.world_size:
            raise UsageError(f"--rank {rank} is out of range: the job has ranks 0-{spec.world_size - 1}")
    keep = _rank_filter(rank)
    offsets: dict[Path, int] = {}

    def drain() -> None:
        for path in task_logs(folder, job_id):
            text = read_new(path, offsets, whole_lines=follow)
            if not text:
                continue
            chosen = [ln for ln in text.splitlines() if keep(ln)]
            if chosen and rank is None and not follow:
                out.write(f"==> {path} <==\n")
            for ln in chosen:
                out.write(ln + "\n")
        out.flush()

    drain()
    while follow:
        info = query_job(job_id)
        over = info is None or info.final
        time.sleep(FOLLOW_POLL_S)
        drain()
        if over:
            break


def cancel(ref: str) -> Cancelled:
    """scancel the job and wait until it has left the queue."""
    run_dir, job_id, info = job(ref)
    if info.final:
        return Cancelled(before=state_of(info), after=state_of(info),
                         message=f"job {job_id} already ended ({info.state}); nothing to cancel")
    t0 = time.monotonic()
    cancel_job(job_id)
    while in_queue(job_id):
        if time.monotonic() - t0 > CANCEL_WAIT_S:
            raise LaunchError(f"job {job_id} is still in the queue {CANCEL_WAIT_S:.0f} s after scancel; "
                              f"check `squeue -j {job_id}` (a node may not be responding)")
        time.sleep(FOLLOW_POLL_S)
    final = query_job(job_id)
    state = final.state if final else "CANCELLED"
    return Cancelled(before=state_of(info), after=state_of(final) if final else State.CANCELLED,
                     message=f"job {job_id} cancelled (was {info.state}, now {state}; left the queue "
                             f"after {time.monotonic() - t0:.1f} s)")

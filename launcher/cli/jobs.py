"""`dlaunch status | logs | cancel RUN_DIR_OR_JOB`: look after a SLURM run, detached or not.

Each takes a run dir (with the `slurm.json` that `run --slurm` wrote) or a bare job id, which
is looked up in runs/*/slurm.json and then through slurmctld. A finished job whose run was
detached gets its result.json (and the usual summary) the first time `status` sees it over.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from launcher.backends.slurm.jobs import JobInfo, cancel_job, in_queue, query_job, read_slurm_file, resolve, task_logs
from launcher.backends.slurm.progress import Progress
from launcher.cli.args import no_extra_args
from launcher.cli.prepare import options
from launcher.errors import LaunchError, UsageError
from launcher.jobs.slurm import existing_result, finish
from launcher.results.table import format_run
from launcher.rundir import RunPaths
from launcher.specs import LaunchSpec

log = logging.getLogger(__name__)

CANCEL_WAIT_S = 30.0
FOLLOW_POLL_S = 0.5


def _job(ref: str) -> tuple[Path | None, str, JobInfo]:
    run_dir, job_id = resolve(ref)
    info = query_job(job_id)
    if info is None:
        raise LaunchError(f"SLURM knows no job {job_id} (purged from accounting, or another cluster)")
    return run_dir, job_id, info


def status(ref: str, *, as_json: bool = False, out: IO[str] = sys.stdout) -> int:
    """Print the job's state, its progress and, once it is over, the run summary."""
    run_dir, job_id, info = _job(ref)
    data: dict[str, Any] = {"job_id": job_id, "state": info.state, "reason": info.reason,
                            "nodes": info.nodes, "exit_code": info.exit_code,
                            "restarts": info.restarts, "run_dir": str(run_dir) if run_dir else None,
                            "progress": None, "result": None}
    lines = [f"job {job_id}: {info.state}" + (f" ({info.reason_text()})" if info.reason_text()
                                               and info.state != "COMPLETED" else "")
             + (f" on {info.nodes}" if info.nodes else "")
             + (f", restarts {info.restarts}" if info.restarts else "")]
    if run_dir is not None:
        lines.append(f"run dir: {run_dir}")
        spec = LaunchSpec.from_dict(json.loads(RunPaths(root=run_dir).launch.read_text(encoding="utf-8")))
        progress = Progress(run_dir, spec.world_size, spec.steps)
        snap = progress.snapshot()
        data["progress"] = {**snap, "steps": {str(k): v for k, v in snap["steps"].items()}}
        result = existing_result(run_dir)
        if info.final and result is None:
            result = finish(run_dir, info, read_slurm_file(run_dir))
        if result is not None and info.final:
            data["result"] = result.to_dict()
            lines.append(format_run(result))
        elif info.state == "RUNNING":
            lines.append(progress.line() or "")
    if as_json:
        out.write(json.dumps(data, indent=2) + "\n")
    else:
        out.write("\n".join(ln for ln in lines if ln) + "\n")
    return 0


def _rank_filter(rank: int | None) -> Callable[[str], bool]:
    prefix = f"[rank {rank}] " if rank is not None else ""
    return lambda line: line.startswith(prefix)


def logs(ref: str, *, rank: int | None = None, follow: bool = False,
         out: IO[str] = sys.stdout) -> int:
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
        spec = LaunchSpec.from_dict(json.loads(RunPaths(root=run_dir).launch.read_text(encoding="utf-8")))
        if rank >= spec.world_size:
            raise UsageError(f"--rank {rank} is out of range: the job has ranks 0-{spec.world_size - 1}")
    keep = _rank_filter(rank)
    offsets: dict[Path, int] = {}

    def drain() -> None:
        for path in task_logs(folder, job_id):
            with open(path, "rb") as f:
                f.seek(offsets.get(path, 0))
                data = f.read()
            end = data.rfind(b"\n") if follow else len(data) - 1
            if end < 0:
                continue
            offsets[path] = offsets.get(path, 0) + end + 1
            text = data[:end + 1].decode("utf-8", errors="replace")
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
    return 0


def cancel(ref: str, *, out: IO[str] = sys.stdout) -> int:
    """scancel the job and wait until it has left the queue."""
    run_dir, job_id, info = _job(ref)
    if info.final:
        out.write(f"job {job_id} already ended ({info.state}); nothing to cancel\n")
        return 0
    t0 = time.monotonic()
    cancel_job(job_id)
    while in_queue(job_id):
        if time.monotonic() - t0 > CANCEL_WAIT_S:
            raise LaunchError(f"job {job_id} is still in the queue {CANCEL_WAIT_S:.0f} s after scancel; "
                              f"check `squeue -j {job_id}` (a node may not be responding)")
        time.sleep(FOLLOW_POLL_S)
    final = query_job(job_id)
    state = final.state if final else "CANCELLED"
    out.write(f"job {job_id} cancelled (was {info.state}, now {state}; left the queue after "
              f"{time.monotonic() - t0:.1f} s)\n")
    return 0


def cmd_status(args: argparse.Namespace, workload_args: list[str]) -> int:
    """`dlaunch status RUN_DIR_OR_JOB`: a SLURM job's state, progress and summary."""
    no_extra_args("status", workload_args)
    values = options("status", args)
    return status(values["job"], as_json=values["json"])


def cmd_logs(args: argparse.Namespace, workload_args: list[str]) -> int:
    """`dlaunch logs RUN_DIR_OR_JOB [--rank R] [--follow]`."""
    no_extra_args("logs", workload_args)
    values = options("logs", args)
    return logs(values["job"], rank=values["rank"], follow=values["follow"])


def cmd_cancel(args: argparse.Namespace, workload_args: list[str]) -> int:
    """`dlaunch cancel RUN_DIR_OR_JOB`: scancel and wait until the job left the queue."""
    no_extra_args("cancel", workload_args)
    return cancel(options("cancel", args)["job"])

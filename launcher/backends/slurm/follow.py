"""A SLURM run from sbatch to its end: submit it, follow the queue and the ranks, say how it ended.

The job is the source of truth for when a run is over (scontrol/sacct state), the rank files on the
shared filesystem for how far it got: a rank summary alone proves nothing under SLURM (a requeued
job leaves the previous attempt's). `ended_of` turns a job that is over into an `Ended` (exit code,
failure line, the timings kept in slurm.json); the driver aggregates the rank files. Never imports
results, report, drivers, cli or runtime.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import signal
import time
from pathlib import Path
from typing import IO, Any

from launcher.backends.base import Ended
from launcher.backends.slurm import submit as backend
from launcher.backends.slurm.progress import Progress, first_step_time
from launcher.backends.slurm.queue import JobInfo, cancel_job, in_queue, query_job, read_slurm_file
from launcher.errors import Interrupted, JobFailed, LaunchError, Refused
from launcher.files import atomic_write_json
from launcher.rundir import RunPaths
from launcher.runspec import LaunchSpec

log = logging.getLogger(__name__)

POLL_S = 0.5
PROGRESS_EVERY_S = 5.0
# after a cancel, how long to let the ranks write their summaries before aggregating
SETTLE_S = 15.0
UNKNOWN_GRACE_S = 30.0  # a job slurmctld does not know yet (just submitted) or any more


class QueueTimeout(JobFailed):
    """The job was still pending after --queue-timeout-min; dlaunch cancelled it."""


def submit_run(spec: LaunchSpec, slurm: backend.SlurmSpec, rendered: backend.RenderedSlurm) -> dict[str, Any]:
    """sbatch the job (launch.json is in the run dir already); returns RUN_DIR/slurm.json as written.
    A job that cannot be submitted is `Refused`, and what was written for it is taken back."""
    run_dir = Path(spec.run_dir)
    submitted_at = time.time()
    try:
        job = backend.submit(spec, slurm, rendered)
    except LaunchError as e:
        _remove_unsubmitted(run_dir)
        raise Refused(str(e)) from None
    record = {"job_id": job.job_id, "submitit_folder": job.folder, "script": job.script_path,
              "run_dir": spec.run_dir, "submitted_at": submitted_at, "nodes": spec.nodes, "procs_per_node": spec.gpus,
              "partition": slurm.partition, "time_min": slurm.time_min, "queue_timeout_min": slurm.queue_timeout_min}
    atomic_write_json(RunPaths(root=run_dir).slurm, record)
    log.debug("submitted job %s for %s", job.job_id, spec.run_dir)
    return record


def _remove_unsubmitted(run_dir: Path) -> None:
    """sbatch refused the job: take back what was written for it, so bad input leaves nothing."""
    paths = RunPaths(root=run_dir)
    paths.launch.unlink(missing_ok=True)
    paths.plan.unlink(missing_ok=True)
    paths.owner.unlink(missing_ok=True)  # the claim goes last: the dir is nobody's once empty
    shutil.rmtree(paths.submitit, ignore_errors=True)
    with contextlib.suppress(OSError):
        run_dir.rmdir()  # only if now empty (a --run-dir may hold other things)


def _say(console: IO[str], text: str) -> None:
    console.write(f"dlaunch: {text}\n")
    console.flush()


def follow(job_id: str, spec: LaunchSpec, slurm: backend.SlurmSpec, *, submitted_at: float,
           console: IO[str]) -> JobInfo:
    """Poll the job until it is over; print state changes and progress. Ctrl-C or SIGTERM to
    dlaunch cancels it; a SIGHUP (a closed terminal) leaves it running."""
    progress = Progress(Path(spec.run_dir), spec.world_size, None if spec.is_script else spec.steps)
    seen: tuple[str, str, int] | None = None
    pending_since = time.monotonic()
    unknown_since: float | None = None
    ran = False
    next_progress = 0.0
    try:
        while True:
            info = query_job(job_id)
            if info is None:
                unknown_since = unknown_since or time.monotonic()
                if time.monotonic() - unknown_since > UNKNOWN_GRACE_S:
                    raise LaunchError(f"SLURM does not know job {job_id} any more; see {spec.run_dir} for what "
                                      "the ranks wrote")
                time.sleep(POLL_S)
                continue
            unknown_since = None
            key = (info.state, info.reason, info.restarts)
            if key != seen:
                _say(console, _state_line(info, submitted_at))
                if info.state == "PENDING" and (ran or info.restarts):
                    pending_since = time.monotonic()  # a requeued job queues again
                seen = key
            if info.state == "RUNNING":
                ran = True
                if time.monotonic() >= next_progress:
                    if line := progress.line():
                        _say(console, line)
                    next_progress = time.monotonic() + PROGRESS_EVERY_S
            elif (info.state == "PENDING" and not ran and not info.restarts
                  and slurm.queue_timeout_min is not None
                  and time.monotonic() - pending_since > slurm.queue_timeout_min * 60):
                cancel_job(job_id)
                why = info.reason_text() or "no reason given"
                raise QueueTimeout(f"job {job_id} still PENDING after {slurm.queue_timeout_min:g} min "
                                   f"({why}); cancelled it. Ask for fewer nodes, another "
                                   "--partition, or a longer --queue-timeout-min")
            if info.final:
                return _settle(info)
            time.sleep(POLL_S)
    except KeyboardInterrupt as e:
        if isinstance(e, Interrupted) and e.signum == signal.SIGHUP:
            # the terminal went away, not the user's wish: the job runs on, as it did when a
            # SIGHUP killed dlaunch outright (`dlaunch status` / `cancel` find it)
            raise
        cancel_job(job_id)
        _say(console, f"interrupted: cancelled job {job_id}")
        raise


def _settle(info: JobInfo) -> JobInfo:
    """Give a cancelled/failed job's ranks a moment to leave the queue (and write summaries)."""
    deadline = time.monotonic() + SETTLE_S
    while in_queue(info.job_id) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    return query_job(info.job_id) or info


def _state_line(info: JobInfo, submitted_at: float) -> str:
    waited = time.time() - submitted_at
    text, why = f"job {info.job_id}: {info.state}", info.reason_text()
    if info.state == "PENDING":
        text += f" ({why})" if why else ""
        if info.restarts:
            text += (f" — requeued (restart {info.restarts}); the ranks restart with "
                     "DLAUNCH_RESUME=1 (resume from the last checkpoint, if any)")
    elif info.state == "RUNNING":
        text += f" on {info.nodes} ({waited:.1f} s after submission)"
        if info.restarts:
            text += f", restart {info.restarts}"
    elif info.final:
        text += f" (exit {info.exit_code})" if info.exit_code else ""
        if why and info.state != "COMPLETED":
            text += f": {why}"
    return text


def ended_of(run_dir: Path, info: JobInfo, record: dict[str, Any]) -> Ended:
    """How a job that is over ended, with its timings kept in slurm.json (`final`)."""
    # A rank's failure exits 1, as torchrun does; srun's own code is racy (the first task's 1, or
    # the 143 of a task it terminated afterwards), so it is only kept for the other end states.
    code = 0 if info.state == "COMPLETED" else 1 if info.state == "FAILED" else (info.exit_status or 1)
    wall = time.time() - float(record.get("submitted_at", time.time()))
    why = info.reason_text()
    failure = (None if info.state == "COMPLETED"
               else f"SLURM job {info.job_id} ended {info.state}" + (f" ({why})" if why else ""))
    timings = {"state": info.state, "submit_to_result_s": wall}
    first = first_step_time(run_dir)
    if first is not None:
        timings["submit_to_first_step_s"] = first - float(record["submitted_at"])
    atomic_write_json(RunPaths(root=run_dir).slurm, {**record, "final": timings})
    return Ended(exit_code=code, failure=failure, wall_time_s=wall, after=timing_line(run_dir, info))


def timing_line(run_dir: Path, info: JobInfo) -> str:
    """`slurm: job N STATE on NODES: submit->first step X s, submit->result Y s`."""
    final = read_slurm_file(run_dir).get("final", {})
    parts = []
    if "submit_to_first_step_s" in final:
        parts.append(f"submit->first step {final['submit_to_first_step_s']:.1f} s")
    parts.append(f"submit->result {final.get('submit_to_result_s', 0.0):.1f} s")
    return f"slurm: job {info.job_id} {info.state} on {info.nodes or '-'}: {', '.join(parts)}"

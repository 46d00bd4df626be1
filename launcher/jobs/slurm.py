"""`dlaunch run --slurm` without argv: submit, follow the queue and the ranks, summarise.

The SLURM counterpart of `jobs.local.run_local`. The job is the source of truth for when a run is
over (scontrol/sacct state), the rank files on the shared filesystem for how far it got: a
rank summary alone proves nothing under SLURM (a requeued job leaves the previous attempt's).

`SlurmBackend` (at the end) is the SLURM implementation of `launcher.backends.base.Backend`:
render, start and follow wrap the functions here; logs and cancel are in
`launcher.backends.slurm.runs`.

Never imports cli or runtime (the ranks are reached through files only).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from launcher.backends.base import Cancelled, JobStatus, Rendered
from launcher.backends.slurm import runs
from launcher.backends.slurm import submit as backend
from launcher.backends.slurm.jobs import JobInfo, cancel_job, in_queue, query_job, read_slurm_file
from launcher.backends.slurm.progress import Progress, first_step_time
from launcher.errors import JobFailed, LaunchError
from launcher.files import atomic_write_json, read_json
from launcher.results.aggregate import aggregate, rank_log_tail
from launcher.results.table import format_run
from launcher.results.types import RunResult
from launcher.rundir import RunPaths
from launcher.secrets import masked_spec_dict
from launcher.specs import LaunchSpec

if TYPE_CHECKING:  # a type only: jobs never imports the request code
    from launcher.request import RunRequest

log = logging.getLogger(__name__)

POLL_S = 0.5
PROGRESS_EVERY_S = 5.0
# after a cancel, how long to let the ranks write their summaries before aggregating
SETTLE_S = 15.0
UNKNOWN_GRACE_S = 30.0  # a job slurmctld does not know yet (just submitted) or any more


class QueueTimeout(JobFailed):
    """The job was still pending after --queue-timeout-min; dlaunch cancelled it."""


def submit_run(spec: LaunchSpec, slurm: backend.SlurmSpec,
               rendered: backend.RenderedSlurm | None = None) -> dict[str, Any]:
    """Write the launch spec, sbatch the job, persist RUN_DIR/slurm.json; returns its content.
    `rendered`: the job already rendered for `spec` (rendered here when not given)."""
    rendered = rendered or backend.render(spec, slurm)
    run_dir = Path(spec.run_dir)
    # secrets in the environment never land on disk in the clear
    atomic_write_json(RunPaths(root=run_dir).launch, masked_spec_dict(spec))
    submitted_at = time.time()
    try:
        job = backend.submit(spec, slurm, rendered)
    except LaunchError:
        _remove_unsubmitted(run_dir)
        raise
    record = {
        "job_id": job.job_id, "submitit_folder": job.folder, "script": job.script_path,
        "run_dir": spec.run_dir, "submitted_at": submitted_at, "nodes": spec.num_nodes,
        "procs_per_node": spec.nproc_per_node, "partition": slurm.partition,
        "time_min": slurm.time_min, "queue_timeout_min": slurm.queue_timeout_min,
    }
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
    try:
        run_dir.rmdir()  # only if now empty (a --run-dir may hold other things)
    except OSError:
        pass


def run_slurm(spec: LaunchSpec, slurm: backend.SlurmSpec, *, as_json: bool = False,
              out: IO[str] = sys.stdout, note: str | None = None) -> RunResult | None:
    """Submit and (unless detached) wait, showing queue state and progress; the RunResult.

    `note` (the plan, or why there is none) is printed once the job is accepted, so a refused
    submission stays a single error line.
    """
    record = submit_run(spec, slurm)
    return follow_submitted(spec, slurm, record, as_json=as_json, out=out, note=note)


def follow_submitted(spec: LaunchSpec, slurm: backend.SlurmSpec, record: dict[str, Any], *,
                     as_json: bool = False, out: IO[str] = sys.stdout,
                     note: str | None = None) -> RunResult | None:
    """`run_slurm` once the job was accepted (`record`: what `submit_run` returned)."""
    job_id = record["job_id"]
    if note:
        print(note, file=sys.stderr if slurm.detach or as_json else out)
    if slurm.detach:
        if as_json:
            out.write(json.dumps({"job_id": job_id, "run_dir": spec.run_dir}) + "\n")
        else:
            out.write(f"submitted job {job_id}\nrun dir: {spec.run_dir}\n"
                      f"follow with: dlaunch status {job_id} | dlaunch logs {job_id} --follow"
                      f" | dlaunch cancel {job_id}\n")
        return None
    console = sys.stderr if as_json else out
    console.write(f"dlaunch: submitted job {job_id} ({spec.num_nodes} node(s) x "
                  f"{spec.nproc_per_node} process(es)); run dir {spec.run_dir}\n")
    console.flush()
    info = follow(job_id, spec, slurm, submitted_at=record["submitted_at"], console=console)
    result = finish(Path(spec.run_dir), info, record)
    out.write(json.dumps(result.to_dict(), indent=2) + "\n" if as_json
              else format_run(result) + "\n" + timing_line(Path(spec.run_dir), info) + "\n")
    return result


def _say(console: IO[str], text: str) -> None:
    console.write(f"dlaunch: {text}\n")
    console.flush()


def follow(job_id: str, spec: LaunchSpec, slurm: backend.SlurmSpec, *, submitted_at: float,
           console: IO[str]) -> JobInfo:
    """Poll the job until it is over; print state changes and progress. Ctrl-C cancels it."""
    progress = Progress(Path(spec.run_dir), spec.world_size, spec.steps)
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
                    raise LaunchError(f"SLURM does not know job {job_id} any more; see "
                                      f"{spec.run_dir} for what the ranks wrote")
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
                    line = progress.line()
                    if line:
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
    except KeyboardInterrupt:
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
    text = f"job {info.job_id}: {info.state}"
    if info.state == "PENDING":
        why = info.reason_text()
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
        why = info.reason_text()
        if why and info.state != "COMPLETED":
            text += f": {why}"
    return text


def finish(run_dir: Path, info: JobInfo, record: dict[str, Any]) -> RunResult:
    """Aggregate the rank files into result.json, with the SLURM outcome in the failures."""
    # A rank's failure exits 1, as torchrun does; srun's own code is racy (the first task's 1, or
    # the 143 of a task it terminated afterwards), so it is only kept for the other end states.
    code = 0 if info.state == "COMPLETED" else 1 if info.state == "FAILED" else (info.exit_status or 1)
    wall = time.time() - float(record.get("submitted_at", time.time()))
    result = with_slurm_node_ids(run_dir, aggregate(run_dir, exit_code=code, wall_time_s=wall))
    if info.state != "COMPLETED":
        why = info.reason_text()
        line = f"SLURM job {info.job_id} ended {info.state}" + (f" ({why})" if why else "")
        result = dataclasses.replace(result, status="failed", failures=(line, *result.failures))
    atomic_write_json(RunPaths(root=run_dir).result, result.to_dict())
    timings = {"state": info.state, "submit_to_result_s": wall}
    first = first_step_time(run_dir)
    if first is not None:
        timings["submit_to_first_step_s"] = first - float(record["submitted_at"])
    atomic_write_json(RunPaths(root=run_dir).slurm, {**record, "final": timings})
    return result


def node_ids_by_host(run_dir: Path) -> dict[str, int]:
    """host -> SLURM node id, from the node.json each node task wrote into its log dir."""
    out: dict[str, int] = {}
    for path in RunPaths(root=run_dir).node_records():
        try:
            data = read_json(path)
            out[str(data["host"])] = int(data["slurm_node_id"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def with_slurm_node_ids(run_dir: Path, result: RunResult) -> RunResult:
    """Report each rank under its SLURM node id, and read its log from that node's log dir.

    torchrun's c10d rendezvous numbers the nodes (GROUP_RANK, what a rank records as its
    node_rank) by sorted host name and pid, not in SLURM_NODEID order, while each node's log
    dir is named after SLURM_NODEID. Where the two disagree, the log tails aggregate found
    belong to another rank's node: map back through the host names. A no-op when the ranks
    already record SLURM's node id.
    """
    ids = node_ids_by_host(run_dir)
    ranks, failures = [], list(result.failures)
    for r in result.ranks:
        nid = ids.get(r.host)
        if nid is None or nid == r.node_rank:
            ranks.append(r)
            continue
        tail = rank_log_tail(run_dir, nid, r.local_rank) if r.status != "ok" else ()
        old = f"rank {r.rank} (host {r.host}, node {r.node_rank},"
        failures = [f.replace(old, f"rank {r.rank} (host {r.host}, node {nid},", 1) for f in failures]
        ranks.append(dataclasses.replace(r, node_rank=nid, log_tail=tail))
    return dataclasses.replace(result, ranks=tuple(ranks), failures=tuple(failures))


def timing_line(run_dir: Path, info: JobInfo) -> str:
    """`slurm: job N STATE on NODES: submit->first step X s, submit->result Y s`."""
    final = read_slurm_file(run_dir).get("final", {})
    parts = []
    if "submit_to_first_step_s" in final:
        parts.append(f"submit->first step {final['submit_to_first_step_s']:.1f} s")
    parts.append(f"submit->result {final.get('submit_to_result_s', 0.0):.1f} s")
    return f"slurm: job {info.job_id} {info.state} on {info.nodes or '-'}: {', '.join(parts)}"


def existing_result(run_dir: Path) -> RunResult | None:
    """result.json of a finished run, if written."""
    path = RunPaths(root=run_dir).result
    return RunResult.from_dict(read_json(path)) if path.is_file() else None


# --- the SLURM Backend (launcher.backends.base): adapters around submit / follow above ---


@dataclass(frozen=True, kw_only=True)
class SlurmRendered:
    """A SLURM run rendered: its spec, the job's SLURM side and the sbatch script."""

    spec: LaunchSpec
    slurm: backend.SlurmSpec
    job: backend.RenderedSlurm

    @property
    def dry_run_text(self) -> str:
        """What `dlaunch run --slurm --dry-run` prints."""
        return backend.dry_run_text(self.spec, self.slurm, self.job)


@dataclass(frozen=True, kw_only=True)
class SlurmHandle:
    """A submitted job: `follow` waits for it (unless detached) and summarises."""

    rendered: SlurmRendered
    record: dict[str, Any]  # RUN_DIR/slurm.json as written at submission
    as_json: bool = False
    note: str | None = None

    @property
    def job_id(self) -> str:
        """SLURM's id of the job."""
        return str(self.record["job_id"])

    def follow(self, out: IO[str]) -> RunResult | None:
        """Print the note; then the job id (detached, None) or follow it to its result."""
        return follow_submitted(self.rendered.spec, self.rendered.slurm, self.record,
                                as_json=self.as_json, out=out, note=self.note)


class SlurmBackend:
    """Jobs submitted with sbatch (submitit); a run is its run dir (slurm.json) or job id."""

    name = "slurm"

    def claims(self, ref: str) -> bool:
        """A run dir with slurm.json, or a bare job id."""
        return runs.claims(ref)

    def render(self, spec: LaunchSpec, request: RunRequest) -> SlurmRendered:
        """The sbatch script and per-node commands for the request's SLURM side."""
        if request.slurm is None:
            raise LaunchError("internal: the SLURM backend was chosen for a run without --slurm")
        return SlurmRendered(spec=spec, slurm=request.slurm, job=backend.render(spec, request.slurm))

    def start(self, rendered: Rendered, *, as_json: bool = False, debug: bool = False,
              note: str | None = None, quiet: bool = False) -> SlurmHandle:
        """sbatch the job (a refusal is one error line; the note waits for `follow`). The
        SLURM follow draws no live progress line (yet): `quiet` changes nothing."""
        if not isinstance(rendered, SlurmRendered):
            raise TypeError(f"the SLURM backend cannot start {type(rendered).__name__}")
        record = submit_run(rendered.spec, rendered.slurm, rendered.job)
        return SlurmHandle(rendered=rendered, record=record, as_json=as_json, note=note)

    def status(self, ref: str) -> JobStatus:
        """The job's state, its progress and, once it is over, the run summary (written to
        result.json the first time a detached run is seen over)."""
        run_dir, job_id, info = runs.job(ref)
        data: dict[str, Any] = {"job_id": job_id, "state": info.state, "reason": info.reason,
                                "nodes": info.nodes, "exit_code": info.exit_code,
                                "restarts": info.restarts,
                                "run_dir": str(run_dir) if run_dir else None,
                                "progress": None, "result": None}
        lines = [f"job {job_id}: {info.state}" + (f" ({info.reason_text()})" if info.reason_text()
                                                   and info.state != "COMPLETED" else "")
                 + (f" on {info.nodes}" if info.nodes else "")
                 + (f", restarts {info.restarts}" if info.restarts else "")]
        steps: dict[int, int] = {}
        total: int | None = None
        if run_dir is not None:
            lines.append(f"run dir: {run_dir}")
            spec = runs.launch_spec(run_dir)
            progress = Progress(run_dir, spec.world_size, spec.steps)
            snap = progress.snapshot()
            steps, total = dict(snap["steps"]), spec.steps
            data["progress"] = {**snap, "steps": {str(k): v for k, v in snap["steps"].items()}}
            result = existing_result(run_dir)
            if info.final and result is None:
                result = finish(run_dir, info, read_slurm_file(run_dir))
            if result is not None and info.final:
                data["result"] = result.to_dict()
                lines.append(format_run(result))
            elif info.state == "RUNNING":
                lines.append(progress.line() or "")
        return JobStatus(state=runs.state_of(info), reason=info.reason_text(),
                         backend_state=info.state, run_dir=str(run_dir) if run_dir else None,
                         steps=steps, total_steps=total,
                         text="\n".join(ln for ln in lines if ln), data=data)

    def logs(self, ref: str, *, out: IO[str], rank: int | None = None,
             follow: bool = False) -> None:
        """The per-node task logs, or one rank's lines of them."""
        runs.logs(ref, rank=rank, follow=follow, out=out)

    def cancel(self, ref: str) -> Cancelled:
        """scancel, and wait until the job has left the queue."""
        return runs.cancel(ref)

"""`SlurmBackend`: the Backend of a SLURM partition's nodes (launcher.backends.base).

It places the ranks on the partition's nodes, never on the login node dlaunch starts on (the device
from sinfo's GRES, CPUs per node from sinfo unless given, the SlurmSpec from the flags and
dlaunch.yaml), renders the sbatch script with its dry run (`submit`), submits and follows the job
(`follow`); and it answers status, logs and cancel of a SLURM run seen from outside, by run dir or
job id (the summary `status` prints once the job is over is the driver's). Never imports results,
report, drivers, cli or runtime, nor submitit.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from launcher.backends.base import (
    CPU_RANKS,
    Ask,
    Cancelled,
    Ended,
    JobStatus,
    Placement,
    Rendered,
    State,
    parse_world_sizes,
    point_shapes,
)
from launcher.backends.progress import ProgressSpec
from launcher.backends.slurm import queue, submit
from launcher.backends.slurm.follow import ended_of, follow, submit_run
from launcher.backends.slurm.progress import Progress
from launcher.backends.slurm.queue import JobInfo
from launcher.errors import LaunchError, UsageError
from launcher.files import read_new
from launcher.rundir import SLURM_FILE, RunPaths
from launcher.runspec import LaunchSpec
from launcher.specs import SlurmSpec

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


def job(ref: str) -> tuple[Path | None, str, JobInfo]:
    """(run dir or None, job id, the job now); a job SLURM does not know is a LaunchError."""
    run_dir, job_id = queue.resolve(ref)
    info = queue.query_job(job_id)
    if info is None:
        raise LaunchError(f"SLURM knows no job {job_id} (purged from accounting, or another cluster)")
    return run_dir, job_id, info


def launch_spec(run_dir: Path) -> LaunchSpec:
    """The run's launch.json."""
    return LaunchSpec.from_dict(json.loads(RunPaths(root=run_dir).launch.read_text(encoding="utf-8")))


@dataclass(frozen=True, kw_only=True)
class SlurmRendered:
    """A SLURM run rendered: its spec, the job's SLURM side and the sbatch script."""

    spec: LaunchSpec
    slurm: SlurmSpec
    job: submit.RenderedSlurm

    @property
    def dry_run_text(self) -> str:
        """The sbatch script, each node's torchrun command and the environment."""
        return submit.dry_run_text(self.spec, self.slurm, self.job)


@dataclass(frozen=True, kw_only=True)
class SlurmHandle:
    """A submitted job: `follow` waits for it (unless detached)."""

    rendered: SlurmRendered
    record: dict[str, Any]  # RUN_DIR/slurm.json as written at submission
    note: str | None = None

    def follow(self, console: IO[str]) -> Ended:
        """Print the note; then leave the job to run (detached) or follow it to its end."""
        spec, slurm, job_id = self.rendered.spec, self.rendered.slurm, str(self.record["job_id"])
        if self.note:
            print(self.note, file=sys.stderr if slurm.detach else console)
        if slurm.detach:
            return Ended(detached=job_id)
        console.write(f"dlaunch: submitted job {job_id} ({spec.nodes} node(s) x {spec.gpus} process(es)); "
                      f"run dir {spec.run_dir}\n")
        console.flush()
        info = follow(job_id, spec, slurm, submitted_at=self.record["submitted_at"], console=console)
        return ended_of(Path(spec.run_dir), info, self.record)


class SlurmBackend:
    """Jobs submitted with sbatch (submitit); a run is its run dir (slurm.json) or job id."""

    name = "slurm"

    def claims(self, ref: str) -> bool:
        """A run dir with slurm.json, or a bare job id (files only: no SLURM command runs)."""
        path = Path(ref).expanduser()
        return (path / SLURM_FILE).is_file() if path.is_dir() else ref.isdigit()

    def place(self, ask: Ask) -> Placement:
        """Nodes of the partition: `ask.nodes` x (--gpus-per-node, or --gpus, or for a doctor the
        partition's GPUs); for a sweep its largest world size, on --gpus-per-node (else the
        partition's) per node. Needs the SLURM commands unless a dry run; bad flags or dlaunch.yaml fail here."""
        flags = ask.slurm
        if flags is None:
            raise LaunchError("internal: the SLURM backend was chosen without --slurm")
        per_node = flags.gpus_per_node
        # --gpus 1 is run's and tune's default: only the doctor's --gpus is None unless given
        if (ask.sizes is None and per_node and ask.gpus not in (None, per_node)
                and (ask.gpus != 1 or ask.command == "doctor")):
            raise UsageError(f"--gpus {ask.gpus} and --gpus-per-node {per_node} disagree; give one")
        # one sinfo for all that follows: each call waits out a controller that is down (~9 s)
        shape = queue.partition_shape(flags.partition) if shutil.which("sinfo") else None
        cpus = flags.cpus_per_node
        if cpus is None and shape:
            cpus = shape[0]
        spec = SlurmSpec(partition=flags.partition, account=flags.account, qos=flags.qos,
                         constraint=flags.constraint, time_min=flags.time_min, opts=flags.slurm_opt,
                         cpus_per_node=cpus, queue_timeout_min=flags.queue_timeout_min, detach=ask.detach)
        if not ask.dry_run:
            submit.check_slurm_available()
        # the login node's own hardware says nothing about the compute nodes
        gres = shape[1] if shape else None
        device = "cuda" if (gres if gres is not None else flags.gpus_per_node) else "cpu"
        nodes = Placement(device=device, here=False, where="SLURM jobs", slurm=spec, topology=ask.topology)
        if ask.sizes is not None:
            if per_node is None and shape:
                per_node = gres if device == "cuda" else (spec.cpus_per_node or shape[0])
            if not per_node:
                raise UsageError("dlaunch scale --slurm: give --gpus-per-node (processes per node); "
                                 "sinfo could not tell how many the partition's nodes have")
            shapes = point_shapes(parse_world_sizes(ask.sizes), per_node)
            return dataclasses.replace(nodes, nodes=shapes[-1][1], gpus=shapes[-1][2], shapes=shapes, per_node=per_node)
        ranks = per_node or ask.gpus
        if not ranks and device == "cuda":  # one rank per GPU of the partition's nodes
            ranks = shape[1] if shape else 0
            if not ranks:
                raise UsageError(f"dlaunch {ask.command} --slurm: give --gpus-per-node; sinfo could not "
                                 "tell how many GPUs the partition's nodes have")
        return dataclasses.replace(nodes, nodes=ask.nodes or 1, gpus=ranks or CPU_RANKS)

    def render(self, spec: LaunchSpec, placement: Placement) -> SlurmRendered:
        """The sbatch script and per-node commands for the placement's SLURM side."""
        if placement.slurm is None:
            raise LaunchError("internal: the SLURM backend was chosen for a run without --slurm")
        return SlurmRendered(spec=spec, slurm=placement.slurm, job=submit.render(spec, placement.slurm))

    def start(self, rendered: Rendered, *, attempt: int = 0, debug: bool = False,
              note: str | None = None, progress: ProgressSpec | None = None) -> SlurmHandle:
        """sbatch the job (a refusal is one error line; the note waits for `follow`). SLURM
        requeues a job itself (no attempts here) and draws no live progress line (yet)."""
        if not isinstance(rendered, SlurmRendered):
            raise TypeError(f"the SLURM backend cannot start {type(rendered).__name__}")
        record = submit_run(rendered.spec, rendered.slurm, rendered.job)
        return SlurmHandle(rendered=rendered, record=record, note=note)

    def status(self, ref: str) -> JobStatus:
        """The job's state and progress; a job over whose run has no result.json yet (it was
        detached) says how it ended, for the driver to write the result once."""
        run_dir, job_id, info = job(ref)
        data: dict[str, Any] = {"job_id": job_id, "state": info.state, "reason": info.reason, "nodes": info.nodes,
                                "exit_code": info.exit_code, "restarts": info.restarts,
                                "run_dir": str(run_dir) if run_dir else None, "progress": None, "result": None}
        lines = [f"job {job_id}: {info.state}" + (f" ({info.reason_text()})" if info.reason_text()
                                                   and info.state != "COMPLETED" else "")
                 + (f" on {info.nodes}" if info.nodes else "")
                 + (f", restarts {info.restarts}" if info.restarts else "")]
        steps: dict[int, int] = {}
        total: int | None = None
        line, ended = "", None
        if run_dir is not None:
            lines.append(f"run dir: {run_dir}")
            spec = launch_spec(run_dir)
            progress = Progress(run_dir, spec.world_size, None if spec.is_script else spec.steps)
            snap = progress.snapshot()
            steps, total = dict(snap["steps"]), None if spec.is_script else spec.steps
            data["progress"] = {**snap, "steps": {str(k): v for k, v in snap["steps"].items()}}
            if info.final and not RunPaths(root=run_dir).result.is_file():
                ended = ended_of(run_dir, info, queue.read_slurm_file(run_dir))
            elif info.state == "RUNNING":
                line = progress.line() or ""
        return JobStatus(state=state_of(info), reason=info.reason_text(), backend_state=info.state,
                         run_dir=str(run_dir) if run_dir else None, steps=steps, total_steps=total,
                         text="\n".join(lines), progress=line, data=data, ended=ended)

    def logs(self, ref: str, *, out: IO[str], rank: int | None = None, follow: bool = False) -> None:
        """The job's per-node task logs (torchrun's and every rank's lines), or one rank's (by its
        `[rank N]` prefix, torchrun.LINE_PREFIX); `follow` prints new lines until the job is over."""
        run_dir, job_id = queue.resolve(ref)
        if run_dir is None:
            raise LaunchError(f"job {job_id} was not started by `dlaunch run --slurm` here "
                              "(no run dir found); its logs are where its sbatch --output points")
        folder = Path(queue.read_slurm_file(run_dir)["submitit_folder"])
        if rank is not None and rank >= (world := launch_spec(run_dir).world_size):
            raise UsageError(f"--rank {rank} is out of range: the job has ranks 0-{world - 1}")
        prefix = f"[rank {rank}] " if rank is not None else ""
        offsets: dict[Path, int] = {}

        def drain() -> None:
            for path in queue.task_logs(folder, job_id):
                text = read_new(path, offsets, whole_lines=follow)
                chosen = [ln for ln in text.splitlines() if ln.startswith(prefix)]
                if chosen and rank is None and not follow:
                    out.write(f"==> {path} <==\n")
                for ln in chosen:
                    out.write(ln + "\n")
            out.flush()

        drain()
        while follow:
            info = queue.query_job(job_id)
            time.sleep(FOLLOW_POLL_S)
            drain()
            if info is None or info.final:
                break

    def cancel(self, ref: str) -> Cancelled:
        """scancel the job and wait until it has left the queue."""
        _, job_id, info = job(ref)
        if info.final:
            return Cancelled(before=state_of(info), after=state_of(info),
                             message=f"job {job_id} already ended ({info.state}); nothing to cancel")
        t0 = time.monotonic()
        queue.cancel_job(job_id)
        while queue.in_queue(job_id):
            if time.monotonic() - t0 > CANCEL_WAIT_S:
                raise LaunchError(f"job {job_id} is still in the queue {CANCEL_WAIT_S:.0f} s after "
                                  f"scancel; check `squeue -j {job_id}` (a node may not be responding)")
            time.sleep(FOLLOW_POLL_S)
        final = queue.query_job(job_id)
        state = final.state if final else "CANCELLED"
        return Cancelled(before=state_of(info), after=state_of(final) if final else State.CANCELLED,
                         message=f"job {job_id} cancelled (was {info.state}, now {state}; left the queue after "
                                 f"{time.monotonic() - t0:.1f} s)")

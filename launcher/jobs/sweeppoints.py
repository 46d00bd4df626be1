"""Running a sweep's points: each into a fresh run directory, recorded in the manifest.

`run_points` launches the points `sweep.run_sweep` asked for, one after another, through a
`launch_point` function (torchrun on this host by default, `launch_local`; a SLURM job per point
from `cli.slurm`), moves aside whatever an earlier attempt left, and rewrites the manifest after
every change so an interrupted sweep resumes where it stopped. A failed point is recorded and
the sweep goes on; an interrupted one (`SweepInterrupted`) stops it.

Never imports cli, report or runtime.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from launcher.backends.monitor import job_pids
from launcher.errors import DlaunchError, LaunchError
from launcher.files import atomic_write_json, open_log_stream
from launcher.jobs.local import run_local
from launcher.jobs.progress import ProgressBar
from launcher.jobs.sweepdir import finished_ok, move_aside
from launcher.results.types import RunResult
from launcher.rundir import RunPaths, SweepPaths, create_run_dir
from launcher.specs import LaunchSpec

log = logging.getLogger(__name__)

# launch_point(spec, console) -> RunResult: runs one point; `console` takes its output
LaunchPoint = Callable[[LaunchSpec, IO[str]], RunResult]


class SweepInterrupted(DlaunchError):
    """The sweep was stopped (Ctrl-C, SIGTERM); re-running the same command resumes it.

    Exits 128 + the signal, as `dlaunch run` does (130 for Ctrl-C, 143 for SIGTERM)."""

    exit_code = 130

    def __init__(self, message: str, *, signum: int = signal.SIGINT) -> None:
        super().__init__(message)
        self.exit_code = 128 + int(signum)


# torchrun's own line when a signal from elsewhere stopped it
_GOT_SIGNAL = re.compile(r"got signal: (\d+)")


@dataclass(frozen=True, kw_only=True)
class SweepPoint:
    """One point of a sweep, as recorded in the manifest."""

    name: str  # ws<N>-r<k>, also the directory name
    world_size: int
    repeat: int
    micro_batch: int
    global_batch: int
    num_nodes: int = 1
    status: str = "pending"
    run_id: str = ""
    error: str | None = None
    attempts: int = 0
    started: float | None = None
    finished: float | None = None
    samples_per_s: float | None = None
    step_time_median_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class SweepResult:
    """What `run_sweep` did: every point's final record, and counts."""

    sweep_dir: Path
    mode: str
    points: tuple[SweepPoint, ...]
    ran: int
    skipped: int

    @property
    def failed(self) -> tuple[SweepPoint, ...]:
        """Points whose last attempt failed."""
        return tuple(p for p in self.points if p.status == "failed")

    @property
    def ok(self) -> bool:
        """True when every point finished with status ok."""
        return all(p.status == "ok" for p in self.points)


def point_name(world_size: int, repeat: int) -> str:
    """Directory name of a point."""
    return f"ws{world_size}-r{repeat}"


def launch_local(spec: LaunchSpec, console: IO[str]) -> RunResult:
    """The default `launch_point`: torchrun on this host via `jobs.local.run_local`.

    A Ctrl-C during the run reaches the local backend, which stops the job and says the run
    was interrupted; a torchrun stopped by a signal from elsewhere dies with a SignalException.
    Either is an interruption of the sweep, not a failed point.
    """
    result = run_local(spec, out=console)
    tlog = RunPaths(root=spec.run_dir).torchrun_log
    text = tlog.read_text(errors="replace") if result.status != "ok" and tlog.exists() else ""
    got = _GOT_SIGNAL.search(text) if "SignalException" in text else None
    if result.status == "interrupted" or got is not None:
        # dlaunch's own signal first: stopping the job, it sent torchrun a SIGTERM of its own
        signum = (result.exit_code - 128 if result.status == "interrupted" and result.exit_code > 128
                  else int(got.group(1)) if got is not None else signal.SIGINT)
        raise SweepInterrupted(f"sweep interrupted: point {Path(spec.run_dir).name} was stopped "
                               "by a signal; run the same command again to resume", signum=signum)
    return result


@dataclass(kw_only=True)
class _Sweep:
    """The state of one call of run_sweep: the points, the manifest, where output goes."""

    sdir: Path
    points: dict[str, SweepPoint]
    manifest: dict[str, Any]
    spec_kwargs: dict[str, Any]  # LaunchSpec fields shared by every point
    launch_point: LaunchPoint
    bar: ProgressBar

    def save(self) -> None:
        """Rewrite the manifest (atomically) with every point's current record."""
        ordered = sorted(self.points.values(), key=lambda p: (p.world_size, p.repeat))
        self.manifest.update(points=[dataclasses.asdict(p) for p in ordered],
                             updated=time.time(),
                             world_sizes=sorted({p.world_size for p in ordered}))
        atomic_write_json(SweepPaths(root=self.sdir).manifest, self.manifest)

    def run(self, name: str, index: int) -> None:
        """Launch one point into a fresh directory and record how it ended."""
        point, pdir = self.points[name], self.sdir / name
        live = job_pids(pdir) if pdir.exists() else {}
        if live:
            # they may still write into the point's files: resuming now would mix two runs
            raise LaunchError(f"{name}: processes of an earlier run still live ("
                              + ", ".join(f"{what} pid {pid}" for pid, what in sorted(live.items()))
                              + "); wait for them to end, or kill them, then run again")
        if pdir.exists():
            moved = move_aside(pdir, self.sdir)
            self.bar.note(f"{name}: moved what a previous attempt left to "
                          f"{moved.relative_to(self.sdir)}")
        run_id = f"{self.sdir.name}-{name}-a{point.attempts + 1}"
        spec = LaunchSpec(run_id=run_id, run_dir=str(pdir), num_nodes=point.num_nodes,
                          nproc_per_node=point.world_size // point.num_nodes,
                          micro_batch=point.micro_batch, **self.spec_kwargs)
        create_run_dir(pdir, run_id)
        point = dataclasses.replace(point, status="running", run_id=run_id, error=None,
                                    attempts=point.attempts + 1, started=time.time(),
                                    finished=None)
        self.points[name] = point
        self.save()
        where = f" on {point.num_nodes} nodes" if point.num_nodes > 1 else ""
        self.bar.update(index, f"{name} running ({point.world_size} rank(s){where}, micro-batch "
                               f"{point.micro_batch})")
        try:
            with open_log_stream(RunPaths(root=pdir).console_log) as console:
                result = self.launch_point(spec, console)
        except (KeyboardInterrupt, SweepInterrupted):
            self.points[name] = dataclasses.replace(point, status="pending",
                                                    error="interrupted; re-run to resume")
            self.save()
            self.bar.note(f"{name}: interrupted; run the same command again to resume")
            raise
        except Exception as e:  # a failed point must not stop the sweep
            log.debug("point %s raised", name, exc_info=True)
            msg = str(e) if isinstance(e, DlaunchError) else f"{type(e).__name__}: {e}"
            point = dataclasses.replace(point, status="failed", error=msg, finished=time.time())
        else:
            ok = result.status == "ok"
            err = None if ok else (result.failures[0] if result.failures
                                   else f"exit code {result.exit_code}")
            point = dataclasses.replace(point, status="ok" if ok else "failed", error=err,
                                        finished=time.time(), samples_per_s=result.samples_per_s,
                                        step_time_median_s=result.step_time_median_s)
        self.points[name] = point
        self.save()
        took = (point.finished or 0.0) - (point.started or 0.0)
        if point.status == "ok":
            self.bar.note(f"{name}: ok, {point.samples_per_s or 0:,.1f} samples/s, median step "
                          f"{point.step_time_median_s or 0:.4f} s ({took:.1f} s)")
        else:
            self.bar.note(f"{name}: FAILED ({took:.1f} s): {point.error} "
                          f"(see {RunPaths(root=pdir).console_log})")


def run_points(sdir: Path, old: dict[str, Any] | None, config: dict[str, Any],
               sizes: list[int], batches: dict[int, int], nodes: dict[int, int], repeats: int,
               force: bool, spec_kwargs: dict[str, Any], launch_point: LaunchPoint,
               topology: Mapping[str, Any] | None, progress: IO[str] | None,
               mode: str) -> SweepResult:
    """Run every wanted point not already done (all under `force`), recording each in the
    manifest as it goes; the sweep's directory is created and locked by the caller."""
    accum = int(spec_kwargs.get("grad_accum_steps", 1))
    known = {p["name"]: SweepPoint(**p) for p in (old or {}).get("points", [])}
    wanted = [point_name(n, k) for n in sizes for k in range(repeats)]
    points: dict[str, SweepPoint] = dict(known)
    for n in sizes:
        for k in range(repeats):
            prev = known.get(point_name(n, k))
            points[point_name(n, k)] = SweepPoint(
                name=point_name(n, k), world_size=n, repeat=k, micro_batch=batches[n],
                global_batch=batches[n] * accum * n, num_nodes=nodes[n],
                attempts=prev.attempts if prev else 0,
                status=prev.status if prev else "pending", run_id=prev.run_id if prev else "")
    manifest: dict[str, Any] = {
        "kind": "sweep", "version": 1, "name": sdir.name, "mode": mode, "config": config,
        "created": (old or {}).get("created", time.time()),
        "topology": topology if topology is not None else (old or {}).get("topology")}
    sweep = _Sweep(sdir=sdir, points=points, manifest=manifest, spec_kwargs=spec_kwargs,
                   launch_point=launch_point, bar=ProgressBar(len(wanted), progress))
    sweep.bar.note(f"sweep {sdir}: {mode} scaling, world sizes {','.join(map(str, sizes))}"
                   + (f", {repeats} repeats" if repeats > 1 else ""))
    sweep.save()  # from now on the directory says it is a sweep (sweepdir.refuse_foreign)
    ran = skipped = 0
    for i, name in enumerate(wanted):
        done = finished_ok(sdir / name)
        if done is not None and not force:
            points[name] = dataclasses.replace(points[name], status="ok", run_id=done.run_id,
                                               samples_per_s=done.samples_per_s,
                                               step_time_median_s=done.step_time_median_s)
            skipped += 1
            sweep.bar.note(f"{name}: ok (already done, skipped; --force re-runs it)")
            continue
        ran += 1
        sweep.run(name, i)
    sweep.save()
    sweep.bar.update(len(wanted), "done")
    ordered = tuple(sorted(points.values(), key=lambda p: (p.world_size, p.repeat)))
    return SweepResult(sweep_dir=sdir, mode=mode, points=ordered, ran=ran, skipped=skipped)

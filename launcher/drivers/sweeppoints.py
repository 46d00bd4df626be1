"""Running a sweep's points: each into a fresh run directory, recorded in the manifest.

`run_points` launches the points `sweep.run_sweep` asked for, one after another, through a
`RunOne`, moves aside whatever an earlier attempt left, and rewrites the manifest after every
change so an interrupted sweep resumes where it stopped. A failed point is recorded and the
sweep goes on; an interrupted one (`SweepInterrupted`) stops it. `ProgressBar` shows how far the
sweep got. Never imports cli, report or runtime.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from launcher.backends.monitor import job_pids
from launcher.drivers.launch import RunOne
from launcher.drivers.sweepdir import finished_ok, move_aside
from launcher.errors import DlaunchError, LaunchError
from launcher.files import open_log_stream
from launcher.results.types import RunResult
from launcher.rundir import RunPaths, create_run_dir
from launcher.runspec import LaunchSpec
from launcher.sweepmanifest import Manifest, SweepPoint, write_manifest

if TYPE_CHECKING:  # a type only: sweep imports this module
    from launcher.drivers.sweep import Sweep

log = logging.getLogger(__name__)

class SweepInterrupted(DlaunchError):
    """The sweep was stopped (Ctrl-C, SIGTERM); re-running the same command resumes it. Exits
    128 + the signal, as `dlaunch run` does (130 for Ctrl-C, 143 for SIGTERM)."""

    exit_code = 130

    def __init__(self, message: str, *, signum: int = signal.SIGINT) -> None:
        super().__init__(message)
        self.exit_code = 128 + int(signum)


# torchrun's own line when a signal from elsewhere stopped it
_GOT_SIGNAL = re.compile(r"got signal: (\d+)")


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


class ProgressBar:
    """`[#####.....] 2/4 points  ws2-r0 running`: redrawn in place on a terminal, one line
    per update otherwise (CI logs)."""

    def __init__(self, total: int, out: IO[str] | None, width: int = 24) -> None:
        self.total, self.out, self.width = total, out, width
        self.tty = bool(out is not None and getattr(out, "isatty", lambda: False)())
        self._drawn = False

    def update(self, done: int, label: str) -> None:
        """Redraw the bar with `done` points finished."""
        if self.out is None:
            return
        filled = self.width * done // max(1, self.total)
        bar = f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total} points  {label}"
        self.out.write("\r\x1b[2K" + bar if self.tty else bar + "\n")
        self._drawn = self.tty
        self.out.flush()

    def note(self, text: str) -> None:
        """Print a line that stays (above the bar on a terminal)."""
        if self.out is None:
            return
        self.out.write(("\r\x1b[2K" if self._drawn else "") + text + "\n")
        self._drawn = False
        self.out.flush()


def point_name(world_size: int, repeat: int) -> str:
    """Directory name of a point."""
    return f"ws{world_size}-r{repeat}"


def interruption(spec: LaunchSpec, result: RunResult) -> SweepInterrupted | None:
    """A point stopped by a signal interrupts the sweep, it did not fail: the user's Ctrl-C
    reaches the backend, which stops the job and says the run was interrupted; a torchrun
    stopped by a signal from elsewhere dies with a SignalException."""
    tlog = RunPaths(root=spec.run_dir).torchrun_log
    text = tlog.read_text(errors="replace") if result.status != "ok" and tlog.exists() else ""
    got = _GOT_SIGNAL.search(text) if "SignalException" in text else None
    if result.status != "interrupted" and got is None:
        return None
    # dlaunch's own signal first: stopping the job, it sent torchrun a SIGTERM of its own
    signum = (result.exit_code - 128 if result.status == "interrupted" and result.exit_code > 128
              else int(got.group(1)) if got is not None else signal.SIGINT)
    return SweepInterrupted(f"sweep interrupted: point {Path(spec.run_dir).name} was stopped "
                            "by a signal; run the same command again to resume", signum=signum)


@dataclass(kw_only=True)
class _Points:
    """The state of one call of run_sweep: the points, the manifest, where output goes."""

    sweep: Sweep
    sdir: Path
    points: dict[str, SweepPoint]
    manifest: Manifest
    run_one: RunOne
    bar: ProgressBar

    def save(self, point: SweepPoint | None = None) -> None:
        """Rewrite the manifest with every point's current record (`point`'s new one first)."""
        if point is not None:
            self.points[point.name] = point
        self.manifest = dataclasses.replace(self.manifest, points=tuple(self.points.values()), updated=time.time())
        write_manifest(self.sdir, self.manifest)

    def run(self, name: str, index: int, shape: tuple[int, int, int]) -> None:
        """Launch one point into a fresh directory and record how it ended."""
        point, pdir = self.points[name], self.sdir / name
        if live := (job_pids(pdir) if pdir.exists() else {}):
            # they may still write into the point's files: resuming now would mix two runs
            raise LaunchError(f"{name}: processes of an earlier run still live ("
                              + ", ".join(f"{what} pid {pid}" for pid, what in sorted(live.items()))
                              + "); wait for them to end, or kill them, then run again")
        if pdir.exists():
            moved = move_aside(pdir, self.sdir)
            self.bar.note(f"{name}: moved what a previous attempt left to {moved.relative_to(self.sdir)}")
        run_id = f"{self.sdir.name}-{name}-a{point.attempts + 1}"
        spec = self.sweep.point(shape, run_id=run_id, run_dir=str(pdir))
        create_run_dir(pdir, run_id)
        point = dataclasses.replace(point, status="running", run_id=run_id, error=None, attempts=point.attempts + 1,
                                    started=time.time(), finished=None)
        self.save(point)
        where = f" on {point.num_nodes} nodes" if point.num_nodes > 1 else ""
        batch = "" if spec.is_script else f", micro-batch {point.micro_batch}"  # a script sets its own
        self.bar.update(index, f"{name} running ({point.world_size} rank(s){where}{batch})")
        try:
            with open_log_stream(RunPaths(root=pdir).console_log) as console:
                result = self.run_one(spec, console)
            stopped = interruption(spec, result)
            if stopped is not None:
                raise stopped
        except (KeyboardInterrupt, SweepInterrupted):
            self.save(dataclasses.replace(point, status="pending", error="interrupted; re-run to resume"))
            self.bar.note(f"{name}: interrupted; run the same command again to resume")
            raise
        except Exception as e:  # a failed point must not stop the sweep
            log.debug("point %s raised", name, exc_info=True)
            msg = str(e) if isinstance(e, DlaunchError) else f"{type(e).__name__}: {e}"
            point = dataclasses.replace(point, status="failed", error=msg, finished=time.time())
        else:
            ok = result.status == "ok"
            err = None if ok else (result.failures[0] if result.failures else f"exit code {result.exit_code}")
            point = dataclasses.replace(point, status="ok" if ok else "failed", error=err,
                                        finished=time.time(), samples_per_s=result.samples_per_s,
                                        step_time_median_s=result.step_time_median_s)
        self.save(point)
        took = (point.finished or 0.0) - (point.started or 0.0)
        if point.status == "ok":
            self.bar.note(f"{name}: ok, {point.samples_per_s or 0:,.1f} samples/s, median step "
                          f"{point.step_time_median_s or 0:.4f} s ({took:.1f} s)")
        else:
            self.bar.note(f"{name}: FAILED ({took:.1f} s): {point.error} (see {RunPaths(root=pdir).console_log})")


def run_points(sweep: Sweep, sdir: Path, old: Manifest | None, config: Mapping[str, Any], *,
               force: bool, run: RunOne, topology: Mapping[str, Any] | None,
               progress: IO[str] | None) -> SweepResult:
    """Run every wanted point not already done (all under `force`), recording each in the
    manifest as it goes; the sweep's directory is created and locked by the caller."""
    known = {p.name: p for p in (old.points if old is not None else ())}
    points: dict[str, SweepPoint] = dict(known)
    wanted: list[tuple[str, tuple[int, int, int]]] = []
    for shape in sweep.shapes:
        n, nodes, _ = shape
        for k in range(sweep.repeats):
            name, prev = point_name(n, k), known.get(point_name(n, k))
            wanted.append((name, shape))
            points[name] = SweepPoint(
                name=name, world_size=n, repeat=k, micro_batch=sweep.batch(n), num_nodes=nodes,
                global_batch=sweep.batch(n) * sweep.template.grad_accum * n, attempts=prev.attempts if prev else 0,
                status=prev.status if prev else "pending", run_id=prev.run_id if prev else "")
    manifest = Manifest(name=sdir.name, mode=sweep.mode, config=config,
                        created=old.created if old is not None else time.time(),
                        topology=topology if topology is not None else (old.topology if old else None))
    state = _Points(sweep=sweep, sdir=sdir, points=points, manifest=manifest, run_one=run,
                    bar=ProgressBar(len(wanted), progress))
    state.bar.note(f"sweep {sdir}: {sweep.mode} scaling, world sizes {','.join(map(str, sweep.sizes))}"
                   + (f", {sweep.repeats} repeats" if sweep.repeats > 1 else ""))
    state.save()  # from now on the directory says it is a sweep (sweepdir.refuse_foreign)
    ran = skipped = 0
    for i, (name, shape) in enumerate(wanted):
        done = finished_ok(sdir / name)
        if done is not None and not force:
            points[name] = dataclasses.replace(points[name], status="ok", run_id=done.run_id,
                                               samples_per_s=done.samples_per_s,
                                               step_time_median_s=done.step_time_median_s)
            skipped += 1
            state.bar.note(f"{name}: ok (already done, skipped; --force re-runs it)")
            continue
        ran += 1
        state.run(name, i, shape)
    state.save()
    state.bar.update(len(wanted), "done")
    ordered = tuple(sorted(points.values(), key=lambda p: (p.world_size, p.repeat)))
    return SweepResult(sweep_dir=sdir, mode=sweep.mode, points=ordered, ran=ran, skipped=skipped)

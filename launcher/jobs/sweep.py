"""Scaling sweeps: one run per (world size, repeat), resumable, one manifest.

Layout of a sweep directory:
  sweep.json        the manifest: the sweep's configuration and every point's status
                    (pending | running | ok | failed), rewritten atomically after each change
  ws<N>-r<k>/       one ordinary run directory per point (launch.json, rank files, result.json)
  .attempts/        point directories moved aside: half-done by an interrupted sweep, failed
                    before a retry, or replaced under --force (kept, never deleted)
  sweep.lock        held while a sweep runs, so two calls never run into one directory

A re-run with the same configuration skips the points whose result.json says ok, moves aside
whatever else a point left behind and runs it again; a failed point is recorded and the sweep
goes on. How a point is launched is a parameter (`launch_point`), so a SLURM backend can run
each point as its own job.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from launcher.errors import DlaunchError, UsageError
from launcher.files import atomic_write_json
from launcher.jobs.progress import ProgressBar
from launcher.jobs.sweepdir import MANIFEST, acquire_lock, finished_ok, first_difference, move_aside, read_manifest
from launcher.results.types import RunResult
from launcher.specs import LaunchSpec

log = logging.getLogger(__name__)

MODES = ("weak", "strong")
POINT_STATUSES = ("pending", "running", "ok", "failed")

# launch_point(spec, console) -> RunResult: runs one point; `console` takes its output
LaunchPoint = Callable[[LaunchSpec, IO[str]], RunResult]


class SweepInterrupted(DlaunchError):
    """The sweep was stopped (Ctrl-C, SIGTERM); re-running the same command resumes it."""

    exit_code = 130


# -- validation --------------------------------------------------------------------------------

def parse_world_sizes(text: str, *, available: int | None = None, flag: str = "--gpus",
                      what: str = "devices") -> list[int]:
    """`"1,2,4"` -> `[1, 2, 4]` (sorted); one-line UsageError for empty items, non-integers,
    values below 1, duplicates, or values above `available` (when given)."""
    items = str(text).split(",")
    if not str(text).strip():
        raise UsageError(f"{flag} needs a comma-separated list of world sizes, e.g. {flag} 1,2,4")
    sizes: list[int] = []
    for i, item in enumerate(items, 1):
        item = item.strip()
        if not item:
            raise UsageError(f"{flag} {text!r}: item {i} is empty; give world sizes like 1,2,4")
        try:
            n = int(item)
        except ValueError:
            raise UsageError(f"{flag} {text!r}: {item!r} is not an integer; give world sizes "
                             "like 1,2,4") from None
        if n < 1:
            raise UsageError(f"{flag} {text!r}: world sizes must be >= 1, got {n}")
        if n in sizes:
            raise UsageError(f"{flag} {text!r}: world size {n} is listed twice; use --repeat R "
                             "to run a point several times")
        sizes.append(n)
    if available is not None and max(sizes) > available:
        raise UsageError(f"{flag} {text!r}: world size {max(sizes)} is more than the {available} "
                         f"{what} available here; drop it, or sweep where more are available")
    return sorted(sizes)


def point_batch(mode: str, world_size: int, *, micro_batch: int, global_batch: int | None,
                grad_accum: int = 1) -> int:
    """The micro-batch of a point: weak keeps `micro_batch` per rank, strong splits
    `global_batch` over the ranks (and accumulation steps); UsageError if it does not divide."""
    if mode not in MODES:
        raise UsageError(f"--mode must be weak or strong, got {mode!r}")
    if mode == "weak":
        return micro_batch
    if global_batch is None:
        raise UsageError("--mode strong keeps the global batch fixed: give --global-batch B "
                         "(a multiple of every world size)")
    per_step = world_size * grad_accum
    if global_batch % per_step:
        hint = math.lcm(world_size, grad_accum)
        raise UsageError(f"--global-batch {global_batch} does not split over {world_size} ranks"
                         + (f" x {grad_accum} accumulation steps" if grad_accum > 1 else "")
                         + f"; use a multiple of {per_step} (every world size must divide it, "
                         f"e.g. {max(hint, global_batch // per_step * per_step) or per_step})")
    return global_batch // per_step


def point_shape(world_size: int, processes_per_node: int | None) -> tuple[int, int]:
    """(nodes, processes per node) of a point: one node while it fits, else whole nodes.

    `processes_per_node` None means one host (a local sweep). UsageError when a world size
    beyond one node is not a multiple of it.
    """
    if processes_per_node is None or world_size <= processes_per_node:
        return 1, world_size
    if world_size % processes_per_node:
        raise UsageError(f"world size {world_size} does not fill whole nodes of {processes_per_node} "
                         f"processes; above one node use multiples of {processes_per_node} "
                         "(or set --gpus-per-node)")
    return world_size // processes_per_node, processes_per_node


def check_plan(mode: str, world_sizes: Sequence[int], *, micro_batch: int,
               global_batch: int | None, grad_accum: int = 1) -> dict[int, int]:
    """Validate the whole sweep before anything runs: world size -> micro-batch."""
    if mode == "weak" and global_batch is not None:
        raise UsageError("--global-batch applies to --mode strong; weak scaling keeps "
                         "--micro-batch per rank")
    if mode == "strong" and global_batch is not None:
        bad = [n for n in world_sizes if global_batch % (n * grad_accum)]
        if bad:
            need = math.lcm(*(n * grad_accum for n in world_sizes))
            raise UsageError(f"--global-batch {global_batch} does not split over world size(s) "
                             f"{', '.join(map(str, bad))}; use a multiple of {need}")
    return {n: point_batch(mode, n, micro_batch=micro_batch, global_batch=global_batch,
                           grad_accum=grad_accum) for n in world_sizes}


# -- manifest ----------------------------------------------------------------------------------

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


def sweep_config(*, workload: str, workload_args: Sequence[str], mode: str,
                 global_batch: int | None, micro_batch: int, steps: int, warmup_steps: int,
                 base_spec_kwargs: Mapping[str, Any], processes_per_node: int | None = None
                 ) -> dict[str, Any]:
    """What must match for a re-run to resume a sweep (world sizes and repeats may grow).

    A SLURM sweep (`processes_per_node` given) records its node shape, so it never resumes
    into a local sweep of the same workload or the other way round.
    """
    probe = LaunchSpec(workload=workload, run_id="x", run_dir="/x", steps=steps,
                       warmup_steps=warmup_steps, micro_batch=micro_batch, **base_spec_kwargs)
    spec = probe.to_dict()
    for key in ("run_id", "run_dir", "nproc_per_node", "num_nodes", "workload", "workload_args",
                "micro_batch"):
        spec.pop(key, None)
    config = {"workload": str(Path(workload).resolve()), "workload_args": list(workload_args),
              "mode": mode, "global_batch": global_batch if mode == "strong" else None,
              "micro_batch": micro_batch if mode == "weak" else None, "spec": spec}
    if processes_per_node is not None:
        config["slurm_processes_per_node"] = processes_per_node
    return config


def default_sweep_dir(config: Mapping[str, Any], root: str | Path = "runs") -> Path:
    """`runs/scale-<stem>-<mode>-<hash>`: the same command finds the same directory again,
    which is what makes an interrupted sweep resume on the next call."""
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:8]
    stem = Path(str(config["workload"])).stem
    return Path(root) / f"scale-{stem}-{config['mode']}-{digest}"


# -- launching ---------------------------------------------------------------------------------

def launch_local(spec: LaunchSpec, console: IO[str]) -> RunResult:
    """The default `launch_point`: torchrun on this host via `runner.run_local`.

    A Ctrl-C during the run reaches the local backend, which stops torchrun (it then dies with
    a SignalException); that is an interruption of the sweep, not a failed point.
    """
    from launcher.jobs.local import run_local

    result = run_local(spec, out=console)
    if result.status != "ok":
        tlog = Path(spec.run_dir) / "torchrun.log"
        text = tlog.read_text(errors="replace") if tlog.exists() else ""
        if "SignalException" in text and "got signal" in text:
            raise SweepInterrupted(f"sweep interrupted: point {Path(spec.run_dir).name} was stopped "
                                   "by a signal; run the same command again to resume")
    return result


def run_sweep(*, workload: str, workload_args: Sequence[str] = (), world_sizes: Sequence[int],
              mode: str = "weak", global_batch: int | None = None, micro_batch: int = 8,
              steps: int = 20, warmup_steps: int = 3, repeats: int = 1, sweep_dir: str | Path,
              force: bool = False, base_spec_kwargs: Mapping[str, Any] | None = None,
              launch_point: LaunchPoint | None = None, topology: Mapping[str, Any] | None = None,
              processes_per_node: int | None = None,
              progress: IO[str] | None = sys.stderr) -> SweepResult:
    """Run (or resume) a scaling sweep and return every point's record.

    `base_spec_kwargs` are further LaunchSpec fields shared by all points (strategy, loader,
    grad_accum_steps, seed, device, env, ...). `topology` (a topology dict) is stored in the
    manifest so the report can set busbw beside the link bandwidth. `processes_per_node` spreads
    points over nodes (`point_shape`; with a `launch_point` that can start several, e.g.
    SLURM). Raises UsageError for a bad configuration before anything is created,
    SweepInterrupted when stopped by a signal.
    """
    base = dict(base_spec_kwargs or {})
    if repeats < 1:
        raise UsageError(f"--repeat must be >= 1, got {repeats}")
    sizes = sorted(set(world_sizes))
    if not sizes or min(sizes) < 1:
        raise UsageError("a sweep needs at least one world size >= 1")
    batches = check_plan(mode, sizes, micro_batch=micro_batch, global_batch=global_batch,
                         grad_accum=int(base.get("grad_accum_steps", 1)))
    nodes = {n: point_shape(n, processes_per_node)[0] for n in sizes}
    config = sweep_config(workload=workload, workload_args=workload_args, mode=mode,
                          global_batch=global_batch, micro_batch=micro_batch, steps=steps,
                          warmup_steps=warmup_steps, base_spec_kwargs=base,
                          processes_per_node=processes_per_node)
    sdir = Path(sweep_dir).expanduser().absolute()
    old = read_manifest(sdir) if sdir.exists() else None
    if old is not None and old.get("config") != config and not force:
        raise UsageError(f"{sdir} holds a sweep with another configuration "
                         f"({first_difference(old.get('config'), config)}); give a new "
                         "--sweep-dir, or --force to re-run every point with the new one")
    sdir.mkdir(parents=True, exist_ok=True)
    lock = acquire_lock(sdir)
    spec_kwargs = {**base, "workload": str(Path(workload).resolve()),
                   "workload_args": tuple(workload_args), "steps": steps,
                   "warmup_steps": warmup_steps}
    try:
        return _run_points(sdir, old if old and old.get("config") == config else None, config,
                           sizes, batches, nodes, repeats, force, spec_kwargs,
                           launch_point or launch_local, topology, progress, mode)
    finally:
        lock.unlink(missing_ok=True)


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
        atomic_write_json(self.sdir / MANIFEST, self.manifest)

    def run(self, name: str, index: int) -> None:
        """Launch one point into a fresh directory and record how it ended."""
        from launcher.rundir import create_run_dir

        point, pdir = self.points[name], self.sdir / name
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
            # 0640 whatever the umask: run dirs are never world-writable
            fd = os.open(pdir / "console.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
            with open(fd, "w", encoding="utf-8") as console:
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
                          f"(see {pdir / 'console.log'})")


def _run_points(sdir: Path, old: dict[str, Any] | None, config: dict[str, Any],
                sizes: list[int], batches: dict[int, int], nodes: dict[int, int], repeats: int,
                force: bool,
                spec_kwargs: dict[str, Any], launch_point: LaunchPoint,
                topology: Mapping[str, Any] | None, progress: IO[str] | None,
                mode: str) -> SweepResult:
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

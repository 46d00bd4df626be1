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

This module checks a sweep's configuration before anything is created, names it
(`sweep_config`, `default_sweep_dir`) and starts it (`run_sweep`); `sweeppoints` runs the
points. Never imports cli, report or runtime.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from launcher.errors import UsageError
from launcher.files import storage
from launcher.jobs.sweepdir import acquire_lock, first_difference, refuse_foreign
from launcher.jobs.sweeppoints import LaunchPoint, SweepResult, launch_local, run_points
from launcher.specs import SWEEP_MODES, LaunchSpec
from launcher.sweepmanifest import read_manifest

log = logging.getLogger(__name__)

MODES = SWEEP_MODES


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


# -- identity ----------------------------------------------------------------------------------

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
    refuse_foreign(sdir)
    old = read_manifest(sdir) if sdir.exists() else None
    if old is not None and old.get("config") != config and not force:
        raise UsageError(f"{sdir} holds a sweep with another configuration "
                         f"({first_difference(old.get('config'), config)}); give a new "
                         "--sweep-dir, or --force to re-run every point with the new one")
    with storage(sdir):
        sdir.mkdir(parents=True, exist_ok=True)
    lock = acquire_lock(sdir)
    spec_kwargs = {**base, "workload": str(Path(workload).resolve()),
                   "workload_args": tuple(workload_args), "steps": steps,
                   "warmup_steps": warmup_steps}
    try:
        return run_points(sdir, old if old and old.get("config") == config else None, config,
                          sizes, batches, nodes, repeats, force, spec_kwargs,
                          launch_point or launch_local, topology, progress, mode)
    finally:
        lock.unlink(missing_ok=True)

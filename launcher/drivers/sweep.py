"""Scaling sweeps: one run per (world size, repeat), resumable, one manifest.

Layout of a sweep directory:
  sweep.json        the manifest (launcher.sweepmanifest): the sweep's configuration and every point's
                    status (pending | running | ok | failed), rewritten atomically after each change
  ws<N>-r<k>/       one ordinary run directory per point (launch.json, rank files, result.json)
  .attempts/        point directories moved aside: half-done by an interrupted sweep, failed
                    before a retry, or replaced under --force (kept, never deleted)
  sweep.lock        held while a sweep runs, so two calls never run into one directory

A sweep (`Sweep`) is a template LaunchSpec run at each world size's shape, `repeats` times. A
re-run with the same configuration skips the points whose result.json says ok, moves aside
whatever else a point left behind and runs it again; a failed point is recorded and the sweep
goes on. Each point runs through a `RunOne` (the driver's `Runner` on the command's backend).

This module checks a sweep's batches, names it (`Sweep.config`, `default_sweep_dir`) and starts
it (`run_sweep`); `sweeppoints` runs the points. Never imports cli, report or runtime.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from launcher.drivers.launch import RunOne
from launcher.drivers.sweepdir import acquire_lock, first_difference, refuse_foreign
from launcher.drivers.sweeppoints import SweepResult, run_points
from launcher.errors import UsageError
from launcher.files import storage
from launcher.runspec import LaunchSpec
from launcher.specs import SWEEP_MODES
from launcher.sweepmanifest import read_manifest


def point_batch(mode: str, world_size: int, *, micro_batch: int, global_batch: int | None, grad_accum: int = 1) -> int:
    """The micro-batch of a point: weak keeps `micro_batch` per rank, strong splits
    `global_batch` over the ranks (and accumulation steps); UsageError if it does not divide."""
    if mode not in SWEEP_MODES:
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


def check_plan(mode: str, world_sizes: Sequence[int], *, micro_batch: int,
               global_batch: int | None, grad_accum: int = 1) -> dict[int, int]:
    """Validate the whole sweep before anything runs: world size -> micro-batch."""
    if mode == "weak" and global_batch is not None:
        raise UsageError("--global-batch applies to --mode strong; weak scaling keeps --micro-batch per rank")
    if mode == "strong" and global_batch is not None:
        if bad := [n for n in world_sizes if global_batch % (n * grad_accum)]:
            need = math.lcm(*(n * grad_accum for n in world_sizes))
            raise UsageError(f"--global-batch {global_batch} does not split over world size(s) "
                             f"{', '.join(map(str, bad))}; use a multiple of {need}")
    return {n: point_batch(mode, n, micro_batch=micro_batch, global_batch=global_batch,
                           grad_accum=grad_accum) for n in world_sizes}


@dataclass(frozen=True, kw_only=True)
class Sweep:
    """A scaling sweep: `template` at each world size of `shapes`, `repeats` times."""

    template: LaunchSpec  # what every point shares; run_id, run_dir, nodes, gpus, micro_batch are its own
    shapes: tuple[tuple[int, int, int], ...]  # (world size, nodes, processes per node), ascending
    mode: str = "weak"
    repeats: int = 1
    global_batch: int | None = None  # strong scaling: split over each point's ranks
    per_node: int | None = None  # processes per node of a multi-node point; None: one host

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise UsageError(f"--repeat must be >= 1, got {self.repeats}")
        if not self.shapes or min(self.sizes) < 1:
            raise UsageError("a sweep needs at least one world size >= 1")
        for n in self.sizes:  # every point's batch splits, before anything is created
            self.batch(n)

    @property
    def sizes(self) -> list[int]:
        """The world sizes, ascending."""
        return [n for n, _, _ in self.shapes]

    def batch(self, world_size: int) -> int:
        """The micro-batch of the points of `world_size`."""
        return point_batch(self.mode, world_size, micro_batch=self.template.micro_batch,
                           global_batch=self.global_batch, grad_accum=self.template.grad_accum)

    def point(self, shape: tuple[int, int, int], *, run_id: str, run_dir: str) -> LaunchSpec:
        """The spec of one point of `shape`."""
        n, nodes, procs = shape
        return dataclasses.replace(self.template, run_id=run_id, run_dir=run_dir, nodes=nodes,
                                   gpus=procs, micro_batch=self.batch(n))

    def config(self) -> dict[str, Any]:
        """What must match for a re-run to resume a sweep (world sizes and repeats may grow). A
        SLURM sweep (`per_node` given) records its node shape: it never resumes a local one."""
        spec = dataclasses.replace(self.template, run_id="x", run_dir="/x").to_dict()
        for key in ("run_id", "run_dir", "gpus", "nodes", "workload", "workload_args", "micro_batch"):
            spec.pop(key, None)
        t = self.template
        config = {"workload": str(Path(t.workload).resolve()), "workload_args": list(t.workload_args),
                  "mode": self.mode, "global_batch": self.global_batch if self.mode == "strong" else None,
                  "micro_batch": t.micro_batch if self.mode == "weak" else None, "spec": spec}
        if self.per_node is not None:
            config["slurm_processes_per_node"] = self.per_node
        return config


def default_sweep_dir(config: Mapping[str, Any], root: str | Path = "runs") -> Path:
    """`runs/scale-<stem>-<mode>-<hash>`: the same command finds the same directory again,
    which is what makes an interrupted sweep resume on the next call."""
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:8]
    return Path(root) / f"scale-{Path(str(config['workload'])).stem}-{config['mode']}-{digest}"


def run_sweep(sweep: Sweep, *, sweep_dir: str | Path, run: RunOne, force: bool = False,
              topology: Mapping[str, Any] | None = None, progress: IO[str] | None = sys.stderr) -> SweepResult:
    """Run (or resume) `sweep` in `sweep_dir`, each point through `run`; every point's record.
    `topology` (a dict) goes in the manifest, so the report sets busbw beside the link bandwidth.
    UsageError for a sweep dir of another configuration, SweepInterrupted when stopped by a signal."""
    config = sweep.config()
    sdir = Path(sweep_dir).expanduser().absolute()
    refuse_foreign(sdir)
    old = read_manifest(sdir) if sdir.exists() else None
    if old is not None and old.config != config and not force:
        raise UsageError(f"{sdir} holds a sweep with another configuration "
                         f"({first_difference(dict(old.config), config)}); give a new "
                         "--sweep-dir, or --force to re-run every point with the new one")
    with storage(sdir):
        sdir.mkdir(parents=True, exist_ok=True)
    lock = acquire_lock(sdir)
    try:
        return run_points(sweep, sdir, old if old is not None and old.config == config else None,
                          config, force=force, run=run, topology=topology, progress=progress)
    finally:
        lock.unlink(missing_ok=True)

"""Resume and preemption for the harness: where training starts, when it saves, when it stops.

Resume (`resume`): with DLAUNCH_RESUME=1 (a `--max-restarts` relaunch, a requeued SLURM job)
every rank loads the newest complete checkpoint of DLAUNCH_CHECKPOINT_DIR (default
RUN_DIR/checkpoints) — model, optimizer, the workload's LR scheduler, RNG streams, and the
GradScaler for fp16 — and training goes on at the next step, in an uninterrupted run's data
order: the DistributedSampler's index list is sliced (`SkipSampler`); nothing is loaded to skip.

Saving (`save`): collective, at the end of a logging window (every rank at the same step):
every `--checkpoint-every` steps and when a preemption (runtime.preemption) was requested; the
rank then ends with status `preempted` (`outcome`) and exit code 0.

Records added to the rank file: `resume` {step, checkpoint, load_s, same_data_order, passed_over}
and `checkpoint` {step, path, save_s, reason}.

Never imports cli, backends, jobs or report; torch at module level (see runtime/__init__).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DistributedSampler

from launcher.rundir import checkpoint_dir as checkpoint_root
from launcher.runspec import LaunchSpec
from launcher.runtime import checkpoint
from launcher.runtime.context import RankContext
from launcher.runtime.preemption import stop_requested
from launcher.runtime.recorder import RankRecorder

log = logging.getLogger(__name__)

# the meta.json keys that fix which sample each step sees: a checkpoint written under other
# values resumes, but not with the data order of an uninterrupted run
_DATA_KEYS = ("global_batch", "dataset_size", "seed", "shuffle")


def checkpoint_dir(spec: LaunchSpec) -> Path:
    """DLAUNCH_CHECKPOINT_DIR, or RUN_DIR/checkpoints."""
    return checkpoint_root(spec.run_dir, os.environ)


@dataclass(frozen=True)
class Outcome:
    """How `harness.train` ended: `ok`, or `preempted` (checkpoint saved; exit 0, resume later)."""

    status: str = "ok"
    summary: dict[str, Any] = field(default_factory=dict)  # extra keys for the rank summary


def window_boundary(step: int, spec: LaunchSpec) -> bool:
    """A window must close after `step` so that a periodic checkpoint lands exactly on it."""
    return spec.checkpoint_every > 0 and step % spec.checkpoint_every == 0


def _data_meta(spec: LaunchSpec) -> dict[str, Any]:
    return {"global_batch": spec.global_batch, "dataset_size": spec.steps * spec.global_batch, "seed": spec.seed,
            "shuffle": spec.loader.shuffle, "micro_batch": spec.micro_batch, "grad_accum": spec.grad_accum}


def save(step: int, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
         scaler: torch.amp.GradScaler, spec: LaunchSpec, ctx: RankContext, recorder: RankRecorder,
         *, reason: str, scheduler: LRScheduler | None = None) -> Path:
    """Collective: checkpoint the state after `step` (a preemption's first says so: SLURM's grace is short)."""
    if reason == "preempted":
        why = stop_requested() or "another rank's preemption signal"
        print(f"dlaunch: rank {ctx.rank}: {why}: saving a checkpoint at step {step}, then stopping",
              file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    extra: dict[str, Any] = {**_data_meta(spec), "reason": reason}
    if scaler.is_enabled():
        # scale and growth tracker: without them fp16 restarts from 65536 and skips steps again
        extra["scaler"] = scaler.state_dict()
    path = checkpoint.save(step, module, optimizer, checkpoint_dir(spec), extra=extra, scheduler=scheduler)
    recorder.add({"kind": "checkpoint", "step": step, "path": str(path), "reason": reason,
                  "save_s": time.perf_counter() - t0, "time": time.time()})
    recorder.flush()
    return path


def outcome(stopped_at: int, spec: LaunchSpec) -> Outcome:
    """`preempted` when a stop request ended training before the last step, else `ok`."""
    if 0 < stopped_at < spec.steps:
        return Outcome("preempted", {"preempted_by": stop_requested() or "another rank", "checkpoint_step": stopped_at})
    return Outcome()


def resume(module: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
           spec: LaunchSpec, ctx: RankContext, recorder: RankRecorder, *,
           scheduler: LRScheduler | None = None) -> int:
    """With DLAUNCH_RESUME=1, load the newest usable checkpoint (collective: `checkpoint.load`);
    the last step it covers, 0 to start from scratch (not a resume, or no checkpoint yet)."""
    if os.environ.get("DLAUNCH_RESUME") != "1":
        return 0
    directory = checkpoint_dir(spec)
    t0 = time.perf_counter()
    loaded = checkpoint.load(module, optimizer, directory, scheduler=scheduler)
    if loaded is None:
        log.warning("rank %d: DLAUNCH_RESUME=1 but no complete checkpoint in %s; starting at "
                    "step 1", ctx.rank, directory)
        recorder.add({"kind": "resume", "step": 0, "checkpoint": None, "time": time.time()})
        return 0
    step, meta = loaded
    if scaler.is_enabled() and meta.get("scaler"):
        scaler.load_state_dict(meta["scaler"])
    now = _data_meta(spec)
    same = all(meta.get(k) == now[k] for k in _DATA_KEYS if k in meta)
    if not same:
        log.warning("rank %d: checkpoint step %d was written with %s, this run has %s: the data "
                    "order differs from an uninterrupted run", ctx.rank, step,
                    {k: meta.get(k) for k in _DATA_KEYS}, {k: now[k] for k in _DATA_KEYS})
    if step >= spec.steps:
        log.warning("rank %d: checkpoint step %d already covers --steps %d; nothing left to train",
                    ctx.rank, step, spec.steps)
    recorder.add({"kind": "resume", "step": step, "checkpoint": str(checkpoint.step_dir(directory, step)),
                  "load_s": time.perf_counter() - t0, "same_data_order": same,
                  "passed_over": meta.get("passed_over", []), "time": time.time()})
    # not flushed here: a flush beats the heartbeat with this step, and the hang watcher would
    # take the resumed rank for started (hang timeout) before its first step (startup timeout)
    return min(step, spec.steps)


class SkipSampler:
    """A sampler yielding the wrapped sampler's indices from position `skip` on: the indices are
    computed (cheap integers), no batch is loaded to skip. DataLoader only iterates it."""

    def __init__(self, sampler: DistributedSampler[int], skip: int) -> None:
        self.sampler, self.skip = sampler, skip

    def __iter__(self) -> Iterator[int]:
        return iter(list(self.sampler)[self.skip:])

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self.skip)

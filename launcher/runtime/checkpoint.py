"""Training checkpoints with torch.distributed.checkpoint (DCP): save, find the latest, load.

Layout under the checkpoint dir (DLAUNCH_CHECKPOINT_DIR = RUN_DIR/checkpoints, shared by all
nodes):

    step-000040/            one complete checkpoint: DCP shards + .metadata (every rank wrote
                            its part), meta.json (step, world size), rng-<rank>.pt (RNG states)
    step-000080.partial/    being written (or the job died while writing): never loaded

A checkpoint becomes visible atomically: all ranks write into `step-N.partial/`, meet at a
barrier, then rank 0 renames it to `step-N/`. DCP saves sharded state (FSDP2) and replicated
state (DDP: rank 0 writes the one copy) alike, and loads into a different world size too.

Collective: every rank of the job must call `save` / `load` with the same arguments at the same
point; works without a process group as well (one process).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d+)$")


def _dist() -> tuple[int, int, bool]:
    import torch.distributed as dist

    up = dist.is_available() and dist.is_initialized()
    return (dist.get_rank() if up else 0), (dist.get_world_size() if up else 1), up


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def _quiet_single_process(up: bool) -> Iterator[None]:
    """DCP warns that it assumes one process even when told so (no_dist); here that is meant."""
    with warnings.catch_warnings():
        if not up:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class _TrainState:
    """Model + optimizer as one DCP `Stateful` (get/set_state_dict handle DDP and FSDP2)."""

    def __init__(self, model: Any, optimizer: Any) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])


def _rng_state() -> dict[str, Any]:
    import random

    import torch

    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import random

    import torch

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def step_dir(directory: str | Path, step: int) -> Path:
    """Where the checkpoint of `step` lives once complete."""
    return Path(directory) / f"step-{step:06d}"


def save(step: int, model: Any, optimizer: Any, directory: str | Path, *,
         extra: dict[str, Any] | None = None, keep: int = 2) -> Path:
    """Save model + optimizer (+ this rank's RNG state) after optimizer step `step`.

    `extra`: JSON-able values for meta.json (e.g. the GradScaler's scale, the data position
    if it is not simply `step`). Keeps the newest `keep` complete checkpoints. Returns the
    checkpoint's directory.
    """
    import torch
    import torch.distributed.checkpoint as dcp

    rank, world, up = _dist()
    final = step_dir(directory, step)
    partial = final.with_name(final.name + ".partial")
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # a leftover of a job killed mid-save
        partial.mkdir(parents=True, exist_ok=True)
    _barrier()
    with _quiet_single_process(up):
        dcp.save({"train": _TrainState(model, optimizer)}, checkpoint_id=str(partial), no_dist=not up)
    torch.save(_rng_state(), partial / f"rng-{rank}.pt")
    if rank == 0:
        meta = {"step": step, "world_size": world, **(extra or {})}
        (partial / "meta.json").write_text(json.dumps(meta))
    _barrier()  # every rank's shard and RNG file is in place
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        _prune(Path(directory), keep)
    _barrier()  # nobody returns before the checkpoint is visible
    log.debug("rank %d: saved step %d to %s", rank, step, final)
    return final


def _prune(directory: Path, keep: int) -> None:
    steps = sorted(complete_steps(directory))
    for s in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(step_dir(directory, s), ignore_errors=True)


def complete_steps(directory: str | Path) -> list[int]:
    """Steps that have a complete checkpoint, ascending."""
    d = Path(directory)
    if not d.is_dir():
        return []
    return sorted(int(m.group(1)) for p in d.iterdir()
                  if (m := _STEP_DIR.match(p.name)) and (p / "meta.json").is_file())


def latest(directory: str | Path) -> int | None:
    """The newest complete checkpoint's step, or None."""
    steps = complete_steps(directory)
    return steps[-1] if steps else None


def load(model: Any, optimizer: Any, directory: str | Path, *,
         step: int | None = None) -> tuple[int, dict[str, Any]] | None:
    """Load the newest (or the given) complete checkpoint into model and optimizer in place.

    Returns (step, meta) — training continues with step + 1 — or None when there is none.
    All ranks must agree on the step: they read the same shared directory, and rank 0's choice
    is broadcast so a checkpoint completing between two ranks' listings cannot split them.
    """
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    rank, world, up = _dist()
    chosen = step if step is not None else latest(directory)
    if up:
        box = [chosen]
        dist.broadcast_object_list(box, src=0)
        chosen = box[0]
    if chosen is None:
        return None
    path = step_dir(directory, chosen)
    with _quiet_single_process(up):
        dcp.load({"train": _TrainState(model, optimizer)}, checkpoint_id=str(path), no_dist=not up)
    meta = json.loads((path / "meta.json").read_text())
    rng = path / f"rng-{rank}.pt"
    if rng.is_file() and meta.get("world_size") == world:  # RNG streams only map 1:1
        _set_rng_state(torch.load(rng, weights_only=False))
    log.debug("rank %d: loaded step %d from %s", rank, chosen, path)
    return chosen, meta

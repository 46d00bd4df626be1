"""Training checkpoints with torch.distributed.checkpoint (DCP): save, find the latest, load.

Layout under the checkpoint dir (DLAUNCH_CHECKPOINT_DIR = RUN_DIR/checkpoints, shared by all nodes):

    step-000040/            one complete checkpoint: DCP shards + .metadata, meta.json (step,
                            world size), rng-<rank>.pt (RNG states), scheduler.pt (the LR
                            scheduler's, if any), optim-zero-<rank>.pt (zero1's optimizer
                            shards: runtime.zero), complete.json (the completion marker: every
                            file with its size and CRC-32)
    step-000080.partial/    being written (or the job died while writing): never loaded; a save
                            that raised removes it

A checkpoint becomes visible atomically: all ranks write into `step-N.partial/`, meet at a
barrier, then rank 0 writes the completion marker and renames the dir to `step-N/`. DCP saves
sharded (FSDP2) and replicated (DDP) state alike, and loads into a different world size too.

A checkpoint is trusted only when every file its marker lists has the listed size and CRC-32: one
cut short or overwritten in place (a full disk, a bad copy, a stray writer) is passed over with
a warning for the next older one, and when none is usable `load` fails with one line naming
each. Each rank checksums every world-size-th file, at save and before a resume (zlib's CRC-32
streams at GB/s; it guards against accidents, not tampering). Markers with sizes only still load.

Collective: every rank of the job must call `save` / `load` with the same arguments at the same
point; works without a process group as well (one process).

Never imports cli, backends, jobs or report; torch at module level, DCP (0.9 s of imports) only
when a checkpoint is saved or loaded (see runtime/__init__).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
import re
import shutil
import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LRScheduler

from launcher.files import atomic_write_json, read_json, shown
from launcher.runtime import zero
from launcher.runtime.recorder import rank_failures

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d+)$")
META = "meta.json"
MARKER = "complete.json"  # written last by rank 0: {step, files: {name: [size, crc32]}}
_CHUNK_BYTES = 8 * 1024**2
_FULL_BELOW_BYTES = 1024**2  # free space under which a failed save is blamed on a full disk
_SHORT_WRITE = "unexpected pos"  # torch.save's zip writer, when the file did not grow as written
SCHEDULER = "scheduler.pt"  # the LR scheduler's state_dict (the same on every rank: rank 0's)


class CheckpointUnusable(RuntimeError):
    """No checkpoint can be resumed from although there are some (each one's reason named)."""


def _dist() -> tuple[int, int, bool]:
    up = dist.is_available() and dist.is_initialized()
    return (dist.get_rank() if up else 0), (dist.get_world_size() if up else 1), up


def _barrier() -> None:
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
    """Model + optimizer as one DCP `Stateful` (get/set_state_dict handle DDP and FSDP2); the
    model alone under zero1, whose optimizer state is saved in shards (runtime.zero)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        # deferred: part of DCP, loaded with it (see the module docstring)
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if zero.is_zero(self.optimizer):
            return {"model": get_model_state_dict(self.model)}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # deferred: part of DCP, loaded with it (see the module docstring)
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        if zero.is_zero(self.optimizer):
            set_model_state_dict(self.model, state["model"])
            return
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _save_synced(path: Path, obj: object) -> None:
    """torch.save `obj` to `path` and fsync it: it must be on disk before the marker vouches for it."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def step_dir(directory: str | Path, step: int) -> Path:
    """Where the checkpoint of `step` lives once complete."""
    return Path(directory) / f"step-{step:06d}"


def save(step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: str | Path, *,
         extra: dict[str, Any] | None = None, keep: int = 2, scheduler: LRScheduler | None = None) -> Path:
    """Save model, optimizer, this rank's RNG state and the LR scheduler's (if any) after step
    `step`, with `extra` (JSON-able, e.g. the GradScaler's scale) in meta.json; keeps the newest
    `keep` complete checkpoints. Returns the checkpoint's directory."""
    # deferred: DCP is loaded only by a run that checkpoints (see the module docstring)
    import torch.distributed.checkpoint as dcp

    rank, world, up = _dist()
    final = step_dir(directory, step)
    partial = final.with_name(final.name + ".partial")
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # a leftover of a job killed mid-save
        partial.mkdir(parents=True, exist_ok=True)
    _barrier()
    try:
        with _quiet_single_process(up):
            dcp.save({"train": _TrainState(model, optimizer)}, checkpoint_id=str(partial), no_dist=not up)
        _save_synced(partial / f"rng-{rank}.pt", _rng_state())
        if zero.is_zero(optimizer):
            name, shard = zero.shard(optimizer, rank)
            _save_synced(partial / name, shard)
        if rank == 0:
            if scheduler is not None:
                _save_synced(partial / SCHEDULER, scheduler.state_dict())
            atomic_write_json(partial / META, {"step": step, "world_size": world, **(extra or {})})
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        # torch.save reports a full disk as a short write ("unexpected pos"), and to the other
        # ranks only as DCP's list of ranks: ask the disk before the partial checkpoint goes,
        # and read the short write in any rank's failure (another rank may have freed it)
        full = _free_bytes(partial.parent) < _FULL_BELOW_BYTES or _SHORT_WRITE in _failure_text(e)
        shutil.rmtree(partial, ignore_errors=True)  # its space goes back to the summary and the next save
        if full and not isinstance(e, SystemExit | KeyboardInterrupt):  # not a stop: a failure
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(partial)) from e
        raise
    _barrier()  # every rank's shard and RNG file is in place
    files = _marker_files(partial, rank, world, up)
    if rank == 0:
        atomic_write_json(partial / MARKER, {"step": step, "files": files})
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        _prune(Path(directory), keep)
    _barrier()  # nobody returns before the checkpoint is visible
    log.debug("rank %d: saved step %d to %s", rank, step, final)
    return final


def _failure_text(e: BaseException) -> str:
    """`e`'s message with those of every rank's failure DCP collected in it."""
    return " ".join([str(e), *map(str, rank_failures(e))])


def _free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on `path`'s file system (large if unknown)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return 1 << 62
    return st.f_bavail * st.f_frsize


def _prune(directory: Path, keep: int) -> None:
    for s in complete_steps(directory)[:-keep] if keep > 0 else []:
        shutil.rmtree(step_dir(directory, s), ignore_errors=True)


def crc32(path: Path) -> int:
    """The CRC-32 of a file's bytes, read in chunks."""
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            value = zlib.crc32(chunk, value)
    return value


def _gather(part: dict[str, Any], up: bool) -> dict[str, Any]:
    """Every rank's `part` merged (a collective when there is a process group)."""
    if not up:
        return part
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, part)
    return {k: v for p in parts for k, v in p.items()}


def _marker_files(path: Path, rank: int, world: int, up: bool) -> dict[str, list[int]]:
    """Collective: every file of the checkpoint with its size and CRC-32, each rank checksumming
    its share (rank 0 lists the files: the shared directory is complete after the barrier)."""
    box: list[Any] = [sorted(str(f.relative_to(path)) for f in path.rglob("*")
                             if f.is_file() and f.name != MARKER) if rank == 0 else None]
    if up:
        dist.broadcast_object_list(box, src=0)
    names: list[str] = box[0]
    mine = {name: [(path / name).stat().st_size, crc32(path / name)] for name in names[rank::world]}
    return _gather(mine, up)


def _step_dirs(directory: str | Path) -> list[int]:
    """Steps with a `step-N` directory (complete or not), ascending."""
    d = Path(directory)
    if not d.is_dir():
        return []
    return sorted(int(m.group(1)) for p in d.iterdir() if (m := _STEP_DIR.match(p.name)))


def complete_steps(directory: str | Path) -> list[int]:
    """Steps whose checkpoint has its completion marker (sizes not checked), ascending."""
    return [s for s in _step_dirs(directory) if (step_dir(directory, s) / MARKER).is_file()]


def problem(path: str | Path, *, share: tuple[int, int] = (0, 1)) -> str | None:
    """Why the checkpoint in `path` cannot be trusted (a cut-off, lost or overwritten file, no
    marker), or None when every file its marker lists has the listed size and CRC-32. `share` =
    (rank, world): checksum only this rank's share of the files (sizes are all checked)."""
    p = Path(path)
    try:
        marker = read_json(p / MARKER)
    except FileNotFoundError:
        return f"no completion marker ({MARKER}): the save never finished"
    except (OSError, ValueError) as e:
        return f"completion marker unreadable ({type(e).__name__})"
    files = marker.get("files") if isinstance(marker, dict) else None
    if not isinstance(files, dict) or META not in files:
        return "completion marker lists no files"
    for name, listed in files.items():
        size = listed[0] if isinstance(listed, list) else listed  # sizes only: an older marker
        try:
            actual = (p / name).stat().st_size
        except OSError:
            return f"{shown(name)} is missing"
        if actual != size:
            return f"{shown(name)} is {actual} bytes, {size} when saved (cut off or overwritten)"
    rank, world = share
    for name in sorted(files)[rank::world]:  # this rank's share of the checksums
        listed = files[name]
        if not isinstance(listed, list) or len(listed) < 2:
            continue
        try:
            actual_crc = crc32(p / name)
        except OSError as e:
            return f"{shown(name)} is unreadable ({type(e).__name__})"
        if actual_crc != listed[1]:
            return (f"{shown(name)} fails its checksum (CRC-32 {actual_crc:08x}, {listed[1]:08x} "
                    "when saved): overwritten or damaged in place")
    return None


def pick(directory: str | Path, step: int | None = None) -> tuple[int | None, list[str]]:
    """The newest checkpoint that passes `problem` (or `step`, if it passes), and `step-N: why` for
    each newer one passed over. Collective: rank 0 lists the candidates, every rank checks its
    share of the checksums, and all agree (one completing between two listings cannot split them)."""
    rank, world, up = _dist()
    box: list[Any] = [[step] if step is not None else list(reversed(_step_dirs(directory)))]
    if up:
        dist.broadcast_object_list(box, src=0)
    bad: list[str] = []
    for s in box[0]:
        path = step_dir(directory, s)
        whys = _gather({str(rank): problem(path, share=(rank, world))}, up)
        why = next((whys[str(r)] for r in range(world) if whys.get(str(r))), None)
        if why is None:
            return s, bad
        bad.append(f"{path.name}: {why}")
    return None, bad


def _load_scheduler(scheduler: LRScheduler, path: Path, rank: int) -> None:
    """The saved scheduler state into `scheduler`; a warning when the checkpoint has none (it
    was written by a run without a scheduler: the schedule restarts from its first step)."""
    saved = path / SCHEDULER
    if saved.is_file():
        scheduler.load_state_dict(torch.load(saved, weights_only=False))
    elif rank == 0:
        log.warning("checkpoint %s holds no LR scheduler state (saved without a scheduler); "
                    "the schedule starts from its beginning", path.name)


def latest(directory: str | Path) -> int | None:
    """The newest usable checkpoint's step (see `problem`), or None."""
    return pick(directory)[0]


def load(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: str | Path, *,
         step: int | None = None, scheduler: LRScheduler | None = None) -> tuple[int, dict[str, Any]] | None:
    """Load the newest usable (or the given) checkpoint (`pick`) into model, optimizer and LR
    scheduler, in place: (step, meta, its `passed_over` naming each newer one not used), or None
    when there is none; `CheckpointUnusable` when none of several is usable."""
    # deferred: DCP is loaded only by a run that checkpoints (see the module docstring)
    import torch.distributed.checkpoint as dcp

    rank, world, up = _dist()
    chosen, bad = pick(directory, step)  # every rank reaches the same verdict (collective)
    if chosen is None:
        if bad:
            raise CheckpointUnusable(f"no usable checkpoint in {directory}: {'; '.join(bad)}")
        return None
    path = step_dir(directory, chosen)
    if bad and rank == 0:
        log.warning("checkpoint %s passed over: %s; resuming from %s instead",
                    "; ".join(b.split(":")[0] for b in bad), "; ".join(bad), path.name)
    try:
        with _quiet_single_process(up):
            dcp.load({"train": _TrainState(model, optimizer)}, checkpoint_id=str(path), no_dist=not up)
        if zero.is_zero(optimizer):
            zero.load_shards(optimizer, path)
        meta = read_json(path / META)
        rng = path / f"rng-{rank}.pt"
        if rng.is_file() and meta.get("world_size") == world:  # RNG streams only map 1:1
            _set_rng_state(torch.load(rng, weights_only=False))
        if scheduler is not None:
            _load_scheduler(scheduler, path, rank)
    except Exception as e:  # sizes right, content not: say which checkpoint in one line
        first = (str(e).strip().splitlines() or [""])[0]
        raise CheckpointUnusable(f"checkpoint {path} cannot be loaded: {type(e).__name__}: "
                                 f"{shown(first, 200)}") from e
    log.debug("rank %d: loaded step %d from %s", rank, chosen, path)
    return chosen, {**meta, "passed_over": bad}

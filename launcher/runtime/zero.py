"""ZeRO-1 (strategy zero1): DDP's gradient all-reduce with the optimizer's state sharded evenly over the
data-parallel ranks, as Megatron-LM's distributed optimizer and nanotron's ZeRO-1 shard it, and its part of
a checkpoint.

- `ZeroOptimizer`: the parameters of each dtype and device move into one flat buffer (each parameter a
  view of it, starting on an ALIGN boundary), padded to a multiple of the world size; rank r owns the r-th
  contiguous 1/n of it. On an accelerator they pass through host memory, so setup holds them once. The workload's own
  optimizer (its class, groups and hyper-parameters, made again) steps the pieces of the parameters that fall
  in that range, each piece a view of the buffer given the matching piece of DDP's averaged gradient; then
  one all-gather (`all_gather_single`, in place) hands every rank every updated parameter. One
  collective per dtype and step: torch's ZeroRedundancyOptimizer, which this replaced, broadcasts once per
  rank (a latency per rank, ~n^2 ring steps in all) and splits by whole parameters (an embedding larger
  than 1/n of the model makes one rank's share many times the others').
- Checkpoints: each rank writes its pieces' state beside DCP's files (the model stays in DCP),
  `optim-zero-<rank>.pt`: {"state": {index: that piece's state}, "ranges": {index: (start, stop) within
  the flattened parameter}, "param_groups": the groups with indices for parameters}, the index being the
  parameter's position over the groups (torch's optimizer state dict numbering). A load reads every shard,
  joins each parameter's pieces (a state tensor as long as its piece is the piece's part; others, AdamW's
  step, are the same in each) and keeps this rank's: a checkpoint resumes at another world size. A shard
  without "ranges" holds whole parameters.
- Only optimizers whose update of an element reads that element's gradient and state alone (ELEMENTWISE):
  a piece may split a parameter, so a rule over a parameter's shape or norm (Adafactor's factored moments,
  a trust ratio) would change; others are one line, exit 2.

Never imports cli, backends, jobs or report; torch at module level.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeGuard

import torch
import torch.distributed as dist

from launcher.errors import UsageError
from launcher.workload import optimizer_kwargs

# all_gather_into_tensor's name from torch 2.13 on (the old one warns there)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
SHARD = "optim-zero-{rank}.pt"
ALIGN = 64  # elements: each parameter starts 256 B (fp32) into the buffer, where vectorised kernels read fastest
# torch's optimizers whose step is per element (their subclasses too)
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adadelta,
               torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Rprop,
               torch.optim.ASGD)
SHARDS = "optim-zero-*.pt"


class ZeroOptimizer(torch.optim.Optimizer):
    """The workload's optimizer (not stepped yet) over this rank's even share of every parameter (the module
    docstring); UsageError when its class cannot be made again from its groups and defaults."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        cls = type(optimizer)
        if not issubclass(cls, ELEMENTWISE):
            raise UsageError(f"strategy zero1 steps pieces of the parameters, so it takes optimizers that update "
                             f"each element on its own ({', '.join(c.__name__ for c in ELEMENTWISE)}); the workload's "
                             f"is {cls.__name__}: use --strategy ddp or fsdp_full")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        groups = [dict(g) for g in optimizer.param_groups]
        params = [p for g in groups for p in g["params"]]
        # each parameter's flat buffer and offset in it: one buffer per (dtype, device)
        at: dict[int, tuple[torch.Tensor, int]] = {}
        self.flats: list[torch.Tensor] = []
        for kind in dict.fromkeys((p.dtype, p.device) for p in params):
            mine = [p for p in params if (p.dtype, p.device) == kind]
            starts = [0]
            for p in mine:
                starts.append(-(-(starts[-1] + p.numel()) // ALIGN) * ALIGN)
            # off the accelerator first: its old storage goes before the buffer comes
            values = [p.detach().cpu() for p in mine]
            for p in mine:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device) if p.device.type != "cpu" else p.data
            flat = torch.zeros(-(-starts[-1] // self.world) * self.world, dtype=kind[0], device=kind[1])
            for p, value, offset in zip(mine, values, starts, strict=False):
                flat[offset:offset + value.numel()].copy_(value.reshape(-1))
                p.data = flat[offset:offset + value.numel()].view_as(value)  # the parameter is now a view of it
                at[id(p)] = (flat, offset)
            del values
            self.flats.append(flat)
        # this rank's pieces: (piece, its parameter, the parameter's index, start, stop within the parameter)
        self.pieces: list[tuple[torch.Tensor, torch.Tensor, int, int, int]] = []
        local_groups = []
        index = 0
        for g in groups:
            held = []
            for p in g["params"]:
                flat, offset = at[id(p)]
                chunk = flat.numel() // self.world
                lo, hi = max(offset, self.rank * chunk), min(offset + p.numel(), (self.rank + 1) * chunk)
                if lo < hi:
                    piece = flat[lo:hi]  # one object: the local optimizer keys its state by it
                    self.pieces.append((piece, p, index, lo - offset, hi - offset))
                    held.append(piece)
                index += 1
            local_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": held})
        try:
            self.optim = cls(local_groups, **optimizer_kwargs(cls, optimizer.defaults))
        except (TypeError, ValueError) as e:
            raise UsageError(f"strategy zero1 makes the workload's optimizer {cls.__name__} again on "
                             f"each rank's share of the parameters, from its param groups and "
                             f"defaults, and that failed: {e}; use --strategy ddp or fsdp_full") from e
        super().__init__(groups, optimizer.defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, local in zip(self.param_groups, self.optim.param_groups, strict=True):
            local.update({k: v for k, v in group.items() if k != "params"})  # a scheduler sets the wrapper's
        for piece, p, _, start, stop in self.pieces:
            piece.grad = None if p.grad is None else p.grad.reshape(-1)[start:stop]
        self.optim.step()
        for piece, *_ in self.pieces:
            piece.grad = None
        for flat in self.flats:
            chunk = flat.numel() // self.world
            _all_gather(flat, flat[self.rank * chunk:(self.rank + 1) * chunk])
        return loss


def is_zero(optimizer: torch.optim.Optimizer) -> TypeGuard[ZeroOptimizer]:
    """Whether `optimizer` is zero1's (its state is saved as shards, not through DCP)."""
    return isinstance(optimizer, ZeroOptimizer)


def _groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The groups as torch's optimizer state dicts hold them: hyper-parameters, and indices for parameters."""
    out, index = [], 0
    for g in optimizer.param_groups:
        out.append({**{k: v for k, v in g.items() if k != "params"},
                    "params": list(range(index, index + len(g["params"])))})
        index += len(g["params"])
    return out


def shard(optimizer: ZeroOptimizer, rank: int) -> tuple[str, dict[str, Any]]:
    """This rank's shard's file name and content: its pieces' state and ranges by parameter index, and groups."""
    local: Any = optimizer.optim
    state = {index: dict(local.state[piece]) for piece, _, index, _, _ in optimizer.pieces if piece in local.state}
    ranges = {index: (start, stop) for _, _, index, start, stop in optimizer.pieces if index in state}
    return SHARD.format(rank=rank), {"state": state, "ranges": ranges, "param_groups": _groups(optimizer)}


def _per_element(key: str, value: Any, length: int) -> bool:
    """Whether a piece's state value holds one number per element of a piece `length` long (torch's
    optimizers keep their counter, the same on every piece, under "step", and torch's own load treats it apart)."""
    return isinstance(value, torch.Tensor) and key != "step" and value.numel() == length


def _cut(state: dict[str, Any], saved: tuple[int, int], kept: tuple[int, int]) -> dict[str, Any]:
    """[kept) of a piece's state saved over [saved)."""
    a, b = saved
    return {k: v.reshape(-1)[kept[0] - a:kept[1] - a].clone() if _per_element(k, v, b - a) else v
            for k, v in state.items()}


def load_shards(optimizer: ZeroOptimizer, directory: Path) -> None:
    """Every shard in `directory` into `optimizer`, keeping this rank's pieces' states (each shard read
    and let go in turn); ValueError when the shards do not cover a piece."""
    paths = sorted(directory.glob(SHARDS))
    if not paths:
        raise FileNotFoundError(f"no zero1 optimizer shards ({SHARDS}) in {directory.name}: "
                                "saved under another strategy")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    mine = {index: (start, stop) for _, _, index, start, stop in optimizer.pieces}
    parts: dict[int, list[tuple[int, int, dict[str, Any]]]] = {}
    groups: list[dict[str, Any]] = []
    for path in paths:
        content = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        ranges = content.get("ranges", {})  # none: whole parameters
        for index, held in content["state"].items():
            saved, want = ranges.get(index, (0, params[index].numel())), mine.get(index, (0, 0))
            lo, hi = max(saved[0], want[0]), min(saved[1], want[1])
            if lo < hi:
                parts.setdefault(index, []).append((lo, hi, _cut(held, saved, (lo, hi))))
        groups = content["param_groups"]
        del content
    for group, kept in zip(optimizer.param_groups, groups, strict=True):
        group.update({k: v for k, v in kept.items() if k != "params"})
    state: dict[int, dict[str, Any]] = {}
    local: Any = optimizer.optim
    order = {id(piece): i for i, piece in enumerate(q for g in local.param_groups for q in g["params"])}
    for piece, _, index, start, stop in optimizer.pieces:
        got = sorted(parts.get(index, []), key=lambda part: part[0])
        if not got:
            continue  # never stepped (no gradient yet): no state, as on every rank
        if sum(hi - lo for lo, hi, _ in got) != stop - start:
            raise ValueError(f"the zero1 shards hold {sum(hi - lo for lo, hi, _ in got)} of the {stop - start} "
                             f"elements of parameter {index} this rank steps: saved from another model")
        first_lo, first_hi, first = got[0]
        state[order[id(piece)]] = {k: torch.cat([part[2][k] for part in got])
                                   if _per_element(k, v, first_hi - first_lo) else v for k, v in first.items()}
    # torch's own load casts each value as its optimizer keeps it (AdamW's step on the CPU or the device)
    local_groups = [{**g, **{k: v for k, v in kept.items() if k != "params"}}
                    for g, kept in zip(_groups(local), groups, strict=True)]
    local.load_state_dict({"state": state, "param_groups": local_groups})


__all__ = ["ZeroOptimizer", "is_zero", "shard", "load_shards", "SHARD", "SHARDS"]

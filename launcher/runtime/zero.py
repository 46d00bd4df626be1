"""ZeRO-1 (strategy zero1): DDP's gradient all-reduce with the optimizer's state sharded over the
data-parallel ranks by torch's ZeroRedundancyOptimizer
(https://pytorch.org/docs/stable/distributed.optim.html), and its part of a checkpoint.

- `zero_optimizer`: the workload's own optimizer (its class, hyper-parameters and parameter
  groups) made again as a ZeroRedundancyOptimizer over that class. Each rank's local optimizer
  steps and holds the state of the parameters assigned to it (greedily by size); after the step
  every rank broadcasts its updated parameters. With `parameters_as_bucket_view` those are one
  flat bucket per rank ("to speed up communication", the docs): one broadcast per rank and step.
- Checkpoints: ZeroRedundancyOptimizer's `state_dict()` needs `consolidate_state_dict(to=0)`
  first, and rank 0 would then hold the whole optimizer state, the memory zero1 is there to
  save. Instead each rank writes its own shard beside DCP's files (the model stays in DCP),
  `optim-zero-<rank>.pt`: {"state": {index: that parameter's state}, "param_groups": the groups
  with indices for parameters}, the index being the parameter's position over the groups (torch's
  optimizer state dict numbering). A load reads every shard and keeps this rank's parameters'
  states: a checkpoint resumes at another world size.

Never imports cli, backends, jobs or report; torch at module level, torch.distributed.optim
(1.5 s of imports: it loads FSDP) only when zero1 makes its optimizer (see runtime/__init__).
"""

from __future__ import annotations

import inspect
import itertools
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

from launcher.errors import UsageError

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer

SHARD = "optim-zero-{rank}.pt"
SHARDS = "optim-zero-*.pt"


def is_zero(optimizer: torch.optim.Optimizer) -> TypeGuard[ZeroRedundancyOptimizer]:
    """Whether `optimizer` is zero1's (its state is saved as shards, not through DCP)."""
    # not imported to ask: a run that made no ZeroRedundancyOptimizer has not loaded its module
    module = sys.modules.get("torch.distributed.optim")
    return module is not None and isinstance(optimizer, module.ZeroRedundancyOptimizer)


def _constructor_kwargs(cls: type, defaults: dict[str, Any]) -> dict[str, Any]:
    """The defaults `cls` takes (AdamW's `decoupled_weight_decay` is a default, not an argument)."""
    params = inspect.signature(cls).parameters  # the constructor's, without self
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in params}


def zero_optimizer(optimizer: torch.optim.Optimizer) -> ZeroRedundancyOptimizer:
    """`optimizer` (the workload's, not stepped yet) as a ZeroRedundancyOptimizer over its class,
    groups and hyper-parameters; UsageError when its class cannot be made again from them."""
    # deferred: 1.5 s of imports that only zero1 needs (see the module docstring)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    cls = type(optimizer)
    groups = [dict(g) for g in optimizer.param_groups]
    try:
        return ZeroRedundancyOptimizer(groups, optimizer_class=cls, parameters_as_bucket_view=True,
                                       **_constructor_kwargs(cls, optimizer.defaults))
    except (TypeError, ValueError) as e:
        raise UsageError(f"strategy zero1 makes the workload's optimizer {cls.__name__} again on "
                         f"each rank's share of the parameters, from its param groups and "
                         f"defaults, and that failed: {e}; use --strategy ddp or fsdp_full") from e


def _indices(optimizer: ZeroRedundancyOptimizer) -> dict[int, int]:
    """id(parameter) -> its index over the parameter groups."""
    params = itertools.chain.from_iterable(g["params"] for g in optimizer.param_groups)
    return {id(p): i for i, p in enumerate(params)}


def shard(optimizer: ZeroRedundancyOptimizer, rank: int) -> tuple[str, dict[str, Any]]:
    """This rank's shard's file name and content: its parameters' state by global index, and groups."""
    index = _indices(optimizer)
    local: Any = optimizer.optim  # the local optimizer over this rank's parameters
    state = {index[id(p)]: dict(local.state[p]) for g in local.param_groups for p in g["params"] if p in local.state}
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [index[id(p)] for p in g["params"]]} for g in optimizer.param_groups]
    return SHARD.format(rank=rank), {"state": state, "param_groups": groups}


def load_shards(optimizer: ZeroRedundancyOptimizer, directory: Path) -> None:
    """Every shard in `directory` into `optimizer`, keeping this rank's parameters' states."""
    index = _indices(optimizer)
    local: Any = optimizer.optim
    mine = {index[id(p)] for g in local.param_groups for p in g["params"]}
    paths = sorted(directory.glob(SHARDS))
    if not paths:
        raise FileNotFoundError(f"no zero1 optimizer shards ({SHARDS}) in {directory.name}: "
                                "saved under another strategy")
    state: dict[int, Any] = {}
    groups: list[dict[str, Any]] = []
    for path in paths:
        shard = torch.load(path, map_location="cpu", weights_only=True)
        state.update({i: s for i, s in shard["state"].items() if i in mine})
        groups = shard["param_groups"]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    # load_state_dict leaves a copy of the states in the wrapper's own `state` as well (on the
    # parameters' device: a second copy of this rank's state on a GPU), which only the
    # consolidated `state_dict()` reads, and that is never called here
    optimizer.state.clear()


__all__ = ["zero_optimizer", "is_zero", "shard", "load_shards", "SHARD", "SHARDS"]

"""The model of a sharded run, built once: rank 0 builds it in host memory as the workload does,
every other rank builds the same modules on the meta device (no memory), and once FSDP has
sharded them each rank's shards are filled from rank 0's values, a parameter at a time (as
Accelerate's `cpu_ram_efficient_loading` and torch's `broadcast_from_rank0` do). A node's host
then holds one fp32 model instead of one per rank (8 x 263 GiB of Llama 3 70B is past a DGX
H100's 1,907 GiB). Values, the RNG state after the build and so the losses are those of a build
on every rank; DDP and one process build as before (every rank needs the whole model anyway).

Never imports cli, backends, drivers or report; torch at module level (see runtime/__init__).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

from launcher.runtime.context import RankContext
from launcher.specs import Strategy
from launcher.workload import Workload

log = logging.getLogger(__name__)

Values = dict[str, torch.Tensor]  # rank 0's parameters and buffers by name, as the workload built them

# module names the checkpoint wrapper inserts between a block and its parent (compile_forward adds none)
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.",)


class _OnMeta(TorchFunctionMode):
    """Tensor constructors without a device go to the meta device; unlike `torch.device("meta")`,
    torch's default device stays as it is, so a workload that tells `dlaunch plan`'s meta-device
    profile apart by `torch.get_default_device()` (hf_causal_lm's MoE stand-in) builds what it trains."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _device_constructors() and kwargs.get("device") is None:
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


def build(workload: Workload, strategy: Strategy, ctx: RankContext) -> tuple[torch.nn.Module, Values | None]:
    """The workload's model and, for a sharded strategy over several ranks, rank 0's values by name (empty
    on other ranks) for `fill` after wrapping: the model's modules are then on the meta device on every rank
    (wrapping runs alike everywhere: tensor parallelism's scatters skip meta tensors). None: built on every
    rank as it is."""
    if not strategy.builds_once(ctx.world_size):
        return workload.build_model(), None
    values: Values = {}
    if ctx.rank == 0:
        built = workload.build_model()
        values = {n: t.detach() for n, t in [*built.named_parameters(), *built.named_buffers()]}
        del built
    seed = torch.initial_seed()  # the harness's
    state = [torch.get_rng_state()]
    failed: str | None = None
    try:
        with _OnMeta():
            model = workload.build_model()
        # a tensor kept as a plain attribute is neither sharded nor filled: it would stay on the meta device
        stray = [f"{m}.{k}".lstrip(".") for m, mod in model.named_modules() for k, v in vars(mod).items()
                 if isinstance(v, torch.Tensor) and v.is_meta]
        failed = f"tensors that are neither parameters nor buffers: {', '.join(stray[:3])}" if stray else None
    except Exception as e:  # the workload's own code; the ranks agree below
        failed = f"{type(e).__name__}: {e}"
    # every rank takes the same path: one whose meta build failed makes all of them build as before
    verdicts: list[str | None] = [None] * ctx.world_size
    dist.all_gather_object(verdicts, failed)
    if any(verdicts):
        log.warning("build_model() failed on the meta device (%s); every rank builds the whole model in host "
                    "memory", next(v for v in verdicts if v))
        del values
        torch.manual_seed(seed)  # where a build on every rank starts
        return workload.build_model(), None
    # the generator as a build on every rank leaves it (dropout, the workload's data)
    dist.broadcast_object_list(state, src=0)
    torch.set_rng_state(state[0])
    return model, values


@torch.no_grad()
def fill(model: torch.nn.Module, values: Values | None, strategy: Strategy, ctx: RankContext) -> None:
    """Give every rank's (sharded) parameters and buffers rank 0's values, after `wrap`: the meta tensors
    are allocated first (offloaded shards in host memory, the rest on the device)."""
    if values is None:
        return
    # deferred, as wrap's: imports only a sharded run needs
    from torch.distributed.tensor import DTensor, distribute_tensor

    # it cuts each rank's slice from a tensor every rank holds without communication from torch 2.7 on
    local_cut = "src_data_rank" in inspect.signature(distribute_tensor).parameters
    device = ctx.device()
    model.to_empty(device="cpu" if strategy.offload else device)
    for module in model.modules():  # buffers live on the device, where FSDP puts them
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        for prefix in _WRAPPER_PREFIXES:
            name = name.replace(prefix, "")
        full = (values[name].to(device).contiguous() if ctx.rank == 0
                else torch.empty(tensor.shape, dtype=tensor.dtype, device=device))
        dist.broadcast(full, src=0)
        if isinstance(tensor, DTensor):
            # this rank's slice, cut as the tensor's placements cut it (torch < 2.7 scatters it again from a
            # rank that holds the same values: no `src_data_rank`)
            local = (distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None) if local_cut
                     else distribute_tensor(full, tensor.device_mesh, tensor.placements))
            tensor.to_local().copy_(local.to_local())
        else:
            tensor.copy_(full)

"""The one place a model is wrapped for a strategy: DDP (and zero1: DDP with the optimizer state
sharded, runtime.zero), FSDP2 (full / grad-op shard), hybrid shard on a 2-D mesh, tensor
parallelism (`strategy.tp` > 1, the workload's `tp_plan`) under FSDP, activation checkpointing of
the blocks (`strategy.checkpointing`: selective per op, every other block or every block),
torch.compile; and the one place its optimizer and LR scheduler are made (`make_optimizer`),
after wrapping, the same way under every strategy.

The harness only sees `Wrapped`: the module to call and how to turn gradient sync off.

Never imports cli, backends, jobs or report; torch at module level, FSDP2 (0.6 s of imports)
only when a strategy shards (see runtime/__init__).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from launcher.errors import UsageError
from launcher.runtime import float8
from launcher.runtime.compiling import compile_forward
from launcher.runtime.context import RankContext
from launcher.runtime.inject import comm_delay_ms, install_comm_delay
from launcher.runtime.zero import ZeroOptimizer
from launcher.specs import SELECTIVE_SAVED_MATMULS, SELECTIVE_SAVED_OPS, Strategy
from launcher.workload import Workload, batch_norms, linear_layers

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True, kw_only=True)
class Wrapped:
    """A model ready to train, and how to skip gradient communication: `accumulate` wraps the
    non-final micro-batches of an accumulation window (DDP skips its all-reduce; FSDP still
    reduce-scatters, the memory the planner assumes; hybrid defers the all-reduce across
    replicas); `no_sync` turns all of it off (the calibration's sync-off pass)."""

    module: torch.nn.Module
    no_sync: Callable[[], contextlib.AbstractContextManager[None]]
    accumulate: Callable[[], contextlib.AbstractContextManager[None]]
    compiled: bool = False
    mesh_shape: tuple[int, ...] | None = None  # FSDP's device mesh; (replicas, shards) for hybrid
    mesh_dims: tuple[str, ...] | None = None  # its dimensions' names: ("dp", "tp") with tp > 1
    tp_group: str | None = None  # the tensor-parallel process group's name (runtime.tp_comm)
    # entered around each micro-batch's loss and backward: loss_parallel() under TP, where a
    # workload's tp_plan keeps the logits split over the vocabulary (a DTensor); else nothing
    loss_context: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext
    float8: dict[str, Any] | None = None  # the layers converted and skipped (runtime.float8)


def _switched_off(setting: Callable[[bool], None]) -> Callable[[], contextlib.AbstractContextManager[None]]:
    """A context manager calling an FSDP2 `setting(False)` for its block and `setting(True)` after."""

    @contextlib.contextmanager
    def off() -> Iterator[None]:
        setting(False)
        try:
            yield
        finally:
            setting(True)

    return off


def _selective_save_ops() -> tuple[frozenset[Any], frozenset[Any]]:
    """(matmuls, other ops) whose outputs selective checkpointing saves: torchtitan's save list
    (torchtitan/models/llama3/infra/parallelize.py `_save_list`) as `specs` names it, and the
    reduce-scatter. Ops this torch build lacks are left out."""
    aten = torch.ops.aten
    matmuls = frozenset(getattr(aten, n).default for n in SELECTIVE_SAVED_MATMULS if hasattr(aten, n))
    other = {getattr(aten, n).default for n in SELECTIVE_SAVED_OPS if hasattr(aten, n)}
    functional = getattr(torch.ops, "_c10d_functional", None)
    if functional is not None and hasattr(functional, "reduce_scatter_tensor"):
        other.add(functional.reduce_scatter_tensor.default)
    return matmuls, frozenset(other)


def _selective_context() -> tuple[Any, Any]:
    """One checkpointed block call's contexts: save what the save list names but every second
    matmul (torchtitan's policy), counted apart in forward and in recompute; recompute the rest."""
    matmuls, other = _selective_save_ops()
    counts: defaultdict[bool, int] = defaultdict(int)

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func in matmuls:
            counts[ctx.is_recompute] += 1
            save = counts[ctx.is_recompute] % 2 == 1
        else:
            save = func in other
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _checkpoint_blocks(model: torch.nn.Module, blocks: list[torch.nn.Module], mode: str) -> list[torch.nn.Module]:
    """Wrap the blocks `mode` checkpoints (all, or blocks 2, 4, ... for every-other, as torchtitan
    counts them) in place in their parent; the blocks, wrapped or not, in order."""
    ids = {id(b) for b in blocks}
    parents = {id(child): (parent, name) for parent in model.modules()
               for name, child in parent.named_children() if id(child) in ids}
    kwargs: dict[str, Any] = {"context_fn": _selective_context} if mode == "selective" else {}
    out = []
    for i, block in enumerate(blocks):
        if mode != "every-other" or i % 2:
            parent, name = parents[id(block)]
            # non-reentrant: works with FSDP2 and compile, and with inputs that need no grad
            block = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kwargs)
            setattr(parent, name, block)
        out.append(block)
    return out


def make_optimizer(workload: Workload, model: torch.nn.Module, ctx: RankContext,
                   strategy: Strategy | None = None) -> tuple[torch.optim.Optimizer, LRScheduler | None]:
    """The workload's optimizer and LR scheduler (or None) for `model` as the workload built it
    (the parameter names it expects; FSDP2 has sharded them in place), already wrapped. Under
    zero1 with several ranks, sharded evenly over them (runtime.zero). Default: AdamW."""
    optimizer = workload.make_optimizer(model, fused=ctx.device_type == "cuda")
    if strategy is not None and strategy.kind == "zero1" and ctx.is_distributed:
        optimizer = ZeroOptimizer(optimizer)
    return optimizer, workload.make_scheduler(optimizer)


def hybrid_mesh_shape(ctx: RankContext, shard_group_size: int | None = None) -> tuple[int, int]:
    """(replicas, shards) of the hybrid mesh: shard within a group (a node's ranks, or
    `shard_group_size`: one host standing in for several nodes in tests), replicate across."""
    shards = shard_group_size or ctx.local_world_size
    if shards < 1 or ctx.world_size % shards:
        raise UsageError(f"--shard-group-size must divide the world size ({ctx.world_size}), "
                         f"got {shards}")
    return ctx.world_size // shards, shards


def tp_mesh_shape(ctx: RankContext, strategy: Strategy,
                  shard_group_size: int | None = None) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The device mesh of tensor parallelism under FSDP, tp innermost (a tp group's ranks are
    consecutive, one node's): (dp, tp), or for hybrid (replicas, shards, tp)."""
    tp = strategy.tp
    if ctx.world_size % tp:
        raise UsageError(f"--tp {tp} must divide the world size ({ctx.world_size})")
    if strategy.kind != "hybrid":
        return (ctx.world_size // tp, tp), ("dp", "tp")
    replicas, group = hybrid_mesh_shape(ctx, shard_group_size)
    if group % tp:
        raise UsageError(f"--tp {tp} must divide the ranks of a shard group ({group})")
    return (replicas, group // tp, tp), ("dp_replicate", "dp_shard", "tp")


def dp_rank(rank: int, tp: int) -> int:
    """The data-parallel rank of global `rank`: its tensor-parallel group's index (tp innermost),
    the same for all `tp` ranks of that group, which read the same micro-batches."""
    return rank // tp


def _tied(model: torch.nn.Module) -> list[list[tuple[torch.nn.Module, str]]]:
    """Groups of (module, attribute) that share one parameter (a head tied to the embedding)."""
    by_id: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            by_id.setdefault(id(param), []).append((module, name))
    return [group for group in by_id.values() if len(group) > 1]


def _parallelize(model: torch.nn.Module, plan: dict[str, Any], tp_mesh: DeviceMesh) -> None:
    """Apply the workload's tensor-parallel plan; parameters tied before are tied again after
    (parallelize_module makes a shared parameter two DTensors, one per module; where both have
    the same placements, as a row-split embedding and a column-split head, they become one)."""
    from torch.distributed.tensor.parallel import parallelize_module

    tied = _tied(model)
    parallelize_module(model, tp_mesh, plan)
    for group in tied:
        first = getattr(*group[0])
        for module, name in group[1:]:
            first_at, other_at = getattr(first, "placements", None), getattr(getattr(module, name), "placements", None)
            if other_at != first_at:
                raise UsageError(f"tp_plan splits the tied parameter {name!r} two ways "
                                 f"({first_at} and {other_at}); split both alike")
            setattr(module, name, first)


def uses_device_mesh(strategy: Strategy) -> bool:
    """Whether `wrap` builds a device mesh for `strategy`: every kind but DDP's (FSDP2)."""
    return strategy.shards_params


def wrap(model: torch.nn.Module, strategy: Strategy, ctx: RankContext, blocks: list[torch.nn.Module],
         *, shard_group_size: int | None = None, tp_plan: dict[str, Any] | None = None) -> Wrapped:
    """Apply `strategy` to `model` (on this rank's device; sharded kinds: on the host, moved a unit at a
    time by fully_shard) and return it ready to train.
    With `strategy.tp` > 1 (FSDP kinds only) `tp_plan` is the workload's plan: torchtitan's
    order, tensor parallelism first, then checkpointing, compile and FSDP per block."""
    if strategy.tp > 1 and not strategy.shards_params:
        raise UsageError(f"--tp {strategy.tp} composes with FSDP (fsdp_full, fsdp_grad_op, "
                         f"hybrid), not {strategy.kind}")
    if strategy.tp > 1 and tp_plan is None:
        raise UsageError(f"--tp {strategy.tp}: the workload's tp_plan does not split this model "
                         f"{strategy.tp} ways (heads, hidden sizes)")
    # torchao's order: convert the linear layers first, then checkpointing, compile and FSDP wrap
    # the converted model (its float8 all-gather needs Float8Linear's weights)
    float8_record = float8.convert(model, strategy, ctx.device_type) if strategy.float8 != "none" else None
    return dataclasses.replace(_wrap(model, strategy, ctx, blocks, shard_group_size, tp_plan), float8=float8_record)


def _wrap(model: torch.nn.Module, strategy: Strategy, ctx: RankContext, blocks: list[torch.nn.Module],
          shard_group_size: int | None, tp_plan: dict[str, Any] | None) -> Wrapped:
    if strategy.shards_params:
        # the mesh first: tensor parallelism needs it before checkpointing renames the blocks
        return _wrap_fsdp(model, strategy, ctx, blocks, shard_group_size, tp_plan)
    if strategy.recomputes and blocks:
        blocks = _checkpoint_blocks(model, blocks, strategy.checkpointing)
    if strategy.compile:
        # the whole model; under DDP Dynamo's DDP optimizer splits it at bucket boundaries
        compile_forward(model, strategy)
    if not ctx.is_distributed:
        return Wrapped(module=model, no_sync=contextlib.nullcontext,
                       accumulate=contextlib.nullcontext, compiled=strategy.compile)
    device_ids = [ctx.local_rank] if ctx.device_type == "cuda" else None
    # grads as bucket views: no second copy of the gradients
    ddp = DDP(model, device_ids=device_ids, gradient_as_bucket_view=True)
    # reduce_dtype bf16: each fp32 bucket cast to bf16, all-reduced, divided by the world, copied back
    hook = _bf16_allreduce_hook if strategy.reduce_dtype == "bf16" else None
    if comm_delay_ms() > 0:
        install_comm_delay(ddp, comm_delay_ms(), hook)
    elif hook is not None:
        ddp.register_comm_hook(None, hook)
    return Wrapped(module=ddp, no_sync=ddp.no_sync, accumulate=ddp.no_sync, compiled=strategy.compile)


def _bf16_allreduce_hook(group, bucket):  # type: ignore[no-untyped-def]  # DDP rejects a string annotation
    """DDP comm hook of `reduce_dtype` bf16: each fp32 bucket cast to bf16, averaged over the ranks
    and copied back. torch's bf16_compress_hook does the same but refuses gloo, which reduces bf16."""
    buffer = bucket.buffer()
    sent = buffer.to(torch.bfloat16).div_(dist.get_world_size(group))

    def copy_back(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        return buffer.copy_(fut.value()[0])

    return dist.all_reduce(sent, group=group, async_op=True).get_future().then(copy_back)


def _wrap_fsdp(model: torch.nn.Module, strategy: Strategy, ctx: RankContext,
               blocks: list[torch.nn.Module], shard_group_size: int | None,
               tp_plan: dict[str, Any] | None) -> Wrapped:
    # deferred: 0.6 s of imports that only a sharded run needs (see runtime/__init__)
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if not dist.is_initialized():
        # init_device_mesh would start the default group itself, one rank included: without
        # the collective timeout and the device id that context.init_distributed gives it
        raise RuntimeError("FSDP needs the process group first: "
                           "init_distributed(ctx, mesh=uses_device_mesh(strategy))")
    tp_group: str | None = None
    loss_context: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext
    if strategy.tp > 1:
        assert tp_plan is not None  # wrap() checked it
        # a vocabulary-split output needs loss_parallel() for its loss and backward (plain tensors: no-op)
        from torch.distributed.tensor.parallel import loss_parallel as loss_context
        shape, names = tp_mesh_shape(ctx, strategy, shard_group_size)
        world_mesh = init_device_mesh(ctx.device_type, shape, mesh_dim_names=names)
        _parallelize(model, tp_plan, world_mesh["tp"])
        # a plan's replicated output (a ColwiseParallel's `to_local()`) is a view:
        # FSDP2 warns on every step that an in-place op on it would skip its backward hook
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        mesh = world_mesh[names[:-1]] if len(names) > 2 else world_mesh["dp"]
        mesh_shape, mesh_dims = shape, names
        tp_group = str(world_mesh["tp"].get_group().group_name)
    elif strategy.kind == "hybrid":
        mesh = init_device_mesh(ctx.device_type, hybrid_mesh_shape(ctx, shard_group_size),
                                mesh_dim_names=("replicate", "shard"))
        mesh_shape, mesh_dims = tuple(mesh.shape), ("replicate", "shard")
    else:
        mesh = init_device_mesh(ctx.device_type, (ctx.world_size,))
        mesh_shape, mesh_dims = tuple(mesh.shape), ("shard",)
    if strategy.recomputes and blocks:
        blocks = _checkpoint_blocks(model, blocks, strategy.checkpointing)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(strategy.precision)
    # params gathered at the compute dtype, gradients reduced in fp32 unless `reduce_dtype` says bf16
    reduce = torch.bfloat16 if strategy.reduce_dtype == "bf16" else torch.float32
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce) if dtype else MixedPrecisionPolicy()
    reshard = strategy.kind != "fsdp_grad_op"
    # offload: the shards live in host memory, pinned where there is a device to copy to (CPU
    # ranks have none: pinning needs CUDA, and the same policy then moves nothing)
    offload = CPUOffloadPolicy(pin_memory=ctx.device_type == "cuda") if strategy.offload else OffloadPolicy()
    if dtype is not None:
        for norm in batch_norms(model):
            # batch norm's kernels take low-precision inputs but not low-precision weights beside
            # fp32 running statistics ("expected scalar type BFloat16 but found Float"): each is
            # a unit of its own that keeps fp32 weights and hands its output back at `dtype`
            fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=dtype)
            fully_shard(norm, mesh=mesh, reshard_after_forward=reshard, offload_policy=offload, mp_policy=fp32)
    for block in blocks:
        if strategy.compile:
            # compile each block, not the root: FSDP's block loop breaks a whole-model graph
            compile_forward(block, strategy)
        for linear in linear_layers(block) if strategy.fsdp_unit == "linear" else ():
            fully_shard(linear, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard, offload_policy=offload)
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard, offload_policy=offload)
    # the root keeps its parameters (embeddings, head) for backward's first op, not gathered again with nothing
    # to hide behind: FSDP2's (and torchtitan's) way for a root not told otherwise, said for every torch version
    sharded = fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False,
                          offload_policy=offload)  # `model`, as FSDPModule
    if strategy.compile and not blocks:
        # no units declared: the whole model is one FSDP unit, so compiling it breaks nothing
        compile_forward(model, strategy)
    accumulate = (_switched_off(sharded.set_requires_all_reduce) if strategy.kind == "hybrid"
                  else contextlib.nullcontext)
    return Wrapped(module=model, no_sync=_switched_off(sharded.set_requires_gradient_sync), accumulate=accumulate,
                   compiled=strategy.compile, mesh_shape=mesh_shape, mesh_dims=mesh_dims, tp_group=tp_group,
                   loss_context=loss_context)

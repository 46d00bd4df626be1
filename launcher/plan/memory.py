"""Per-rank peak memory model for one (ModelProfile, Strategy, micro-batch).

Pure arithmetic on the frozen specs: no torch, no I/O; never imports cli, backends, jobs, runtime,
results or report. Every byte this model counts is named in `MemoryEstimate.assumptions`, because
published formulas disagree (ZeRO counts 16 B/param for mixed-precision Adam, HF docs 18,
DeepSpeed's estimator 20) and a user must be able to see which terms were counted.

The model, per rank (P = parameters, G = shard group size, c = compute-dtype bytes):

- parameters and gradients fp32 (4 B/param each): FSDP2 `MixedPrecisionPolicy(param_dtype=bf16)`
  keeps fp32 shards and all-gathers bf16 copies for compute; DDP + autocast keeps fp32
  parameters and caches bf16 copies of the weights for the forward. The optimizer's state as the
  profile measured the workload's own (`profile.optimizer_state_bytes_per_param`: AdamW m and v
  8 B/param, SGD momentum 4, without momentum 0), else (a profile made elsewhere) the goal's
  `optimizer` from `OPTIMIZER_STATE_BYTES`.
- DDP: everything whole. Gradient buckets cost nothing extra because the runtime builds DDP with
  `gradient_as_bucket_view=True` (the grads ARE views of the buckets); without it the reducer
  would hold a second flat copy of all gradients (+4 B/param). Under autocast the cached
  compute-dtype weights (+c B/param) live until backward consumes them: counted as activations.
- zero1 (ZeRO-1 over DDP, runtime/zero.py): as DDP, but each of the N ranks keeps the
  optimizer state of its even 1/N of the parameters only (opt / N; the parameters are the fp32
  ones, no separate master copy, as DDP). After its step one all-gather fills the parameters
  in place: they are views of one flat buffer, each rank's 1/N of it the all-gather's input,
  so it needs no buffer of its own (0 B).
- FSDP full shard (ZeRO-3): params, grads, optimizer / G, plus the unsharded units: the root
  unit (parameters outside the blocks: embeddings, head), two blocks (the current one and the
  prefetched one) at the compute dtype, one block's gradients, and the reduce-scatter input FSDP2
  copies them into (`Strategy.reduce_dtype`) beyond the activations that block's backward freed.
  Under `fsdp_unit` linear the units are each block's linear layers and the rest of the block.
  The blocks' units live during the blocks' backward, not at its start: when the loss gradient
  (backward's transient) peaks, every block has been resharded after its forward and no
  gradient exists yet (measured on CPU, torch 2.13: the peak is log_softmax's backward), so
  they and the transient count once, the larger; the root keeps its parameters from forward to
  backward (runtime.wrap: its backward starts at once), beside the transient.
- FSDP shard-grad-op (ZeRO-2, reshard_after_forward=False): the whole model stays unsharded at
  the compute dtype from forward to backward; fp32 params, grads and optimizer are sharded.
- hybrid: full shard inside the shard group (one node), replicated across nodes.
- tensor parallelism (`Strategy.tp` = t, with sequence parallelism, FSDP over the t-th of the
  ranks that share one TP slice): every block's matmul weights are split by t, and the usual
  Llama plan row-splits the embedding and column-splits the head, so params, grads and optimizer
  state are / (t x G), the unsharded units (root + 2 blocks, one block's grads) / t. The
  norms' weights, replicated on the t ranks, are a few thousand parameters per block: not
  counted apart. Activations are / t: with TP + SP every saved activation is split (Korthikanti
  et al. 2022, "Reducing Activation Recomputation", Table 2). Backward's transient (the loss
  gradient over the vocabulary) is / t where the workload's plan keeps the logits split over the
  vocabulary (`profile.tp_loss_parallel`; torchtitan's loss parallel, workloads/gpt.py's
  `tp_plan`: the harness runs the loss and backward in `loss_parallel()`), whole where a plan
  gathers them. The caller's G is the FSDP group (world/t ranks, or devices per node / t under
  hybrid).
- activations and backward's transient: `plan.activations`. One process reaches the transient
  before most gradients exist: there it counts only beyond the half of the gradients made.
- CPU offload (FSDP kinds, `offload`, on GPUs): the shard's fp32 params, grads and optimizer
  state live in host memory (`host_bytes`, not in the GPU's total); the unsharded units and the
  activations stay (`launcher.plan.offload` prices the copies and the host's optimizer step).
- overhead: CUDA context, NCCL buffers and allocator slack on CUDA; nothing on CPU.
"""

from __future__ import annotations

import dataclasses
import logging

from launcher.hardware.types import DeviceSpec
from launcher.plan.activations import (
    COMPUTE_DTYPE_BYTES,
    activation_bytes,
    activation_factors,
    compile_factor,
    fused_loss_bytes,
    scores_factors,
    transient_bytes,
)
from launcher.plan.checkpointing import describe
from launcher.plan.types import MemoryEstimate
from launcher.specs import GIB, ModelProfile, Strategy

logger = logging.getLogger(__name__)

# Bytes per parameter of the persistent training state (ZeRO paper, Rajbhandari et al. 2020, s3.1:
# fp32 master weights, fp32 grads in PyTorch AMP, Adam m and v in fp32).
MASTER_PARAM_BYTES = 4
GRAD_BYTES = 4
OPTIMIZER_STATE_BYTES = {"adamw": 8, "sgd": 4}  # AdamW: exp_avg + exp_avg_sq; SGD: momentum buffer


DDP_BUCKET_CAP_BYTES = 25 * 1024**2  # torch DDP default bucket_cap_mb=25

# A CUDA 12 context with lazy module loading: nvidia-smi shows ~0.4-0.6 GiB for a rank that has
# allocated nothing (H100, torch 2.x).
CUDA_CONTEXT_BYTES = 0.5 * GIB
# cuBLAS and cuBLASLt each keep a workspace per handle and stream, which PyTorch allocates through
# its caching allocator (so `max_memory_allocated` counts them): 32 MiB each on Hopper and later,
# the size the cuBLAS documentation recommends there. Measured on an H100 (torch 2.11,
# benchmarks/memory_truth.py --device cuda): 60-68 MB above the model's tensors for every
# shipped workload. Older GPUs take less; counted the same (the estimate errs towards fitting).
CUBLAS_WORKSPACE_BYTES = 2 * 32 * 1024**2
# NCCL communicator buffers: NCCL_BUFFSIZE 4 MiB per channel and peer direction, up to 32
# channels on NVSwitch systems -> ~0.25 GiB per process group that has run a collective.
NCCL_BUFFER_BYTES = 0.25 * GIB
# Caching-allocator slack as a fraction of the tensors it holds, with expandable_segments:True
# (which the plan sets); without it fragmentation of 10-30% is common on long runs.
CUDA_ALLOCATOR_SLACK = 0.05
# One process without DDP frees its gradients every step (zero_grad(set_to_none=True)), so
# gradients and activations are never all live at once. Measured on CPU, torch 2.13, for the
# shipped workloads (tests/unit/test_memory_truth.py): while backward frees activations about half
# the gradients already exist; the optimizer step then peaks at all gradients plus foreach
# AdamW's temporaries, 0.57 x the fp32 parameter bytes (fused AdamW on CUDA has none).
SINGLE_PROCESS_GRAD_OVERLAP = 0.5
FOREACH_ADAMW_TEMP_FACTOR = 0.57


def usable_mem_bytes(device: DeviceSpec, headroom: float) -> float:
    """Bytes of `device` a plan may fill, leaving `headroom` (a fraction) free."""
    return device.mem_gib * GIB * (1.0 - headroom)


def unsharded_root_params(profile: ModelProfile) -> int:
    """Parameters outside the blocks (embeddings, final norm, head): FSDP's root unit."""
    return max(0, profile.num_params - profile.num_blocks * profile.largest_block_params)


def largest_unit_params(profile: ModelProfile, strategy: Strategy) -> int:
    """The most parameters one FSDP unit in a block gathers: a block, or its largest linear layer or rest."""
    linear = strategy.fsdp_unit == "linear" and profile.linear_unit_params  # 0: not profiled, priced as blocks
    return profile.linear_unit_params if linear else profile.largest_block_params


def units_per_block(profile: ModelProfile, strategy: Strategy) -> int:
    """FSDP units a block makes: 1, or under `fsdp_unit` linear its linear layers and its rest."""
    return max(1, profile.linear_units_per_block) if strategy.fsdp_unit == "linear" else 1


def optimizer_state_bytes(profile: ModelProfile, optimizer: str) -> tuple[float, str]:
    """Optimizer state bytes per parameter and what they are: the workload's optimizer as
    profiled ("SGD (make_optimizer)"), else the goal's `optimizer` ("adamw (assumed)")."""
    if profile.optimizer:
        return profile.optimizer_state_bytes_per_param, profile.optimizer
    return float(OPTIMIZER_STATE_BYTES[optimizer]), f"{optimizer} (assumed)"


def optimizer_step_share(profile: ModelProfile) -> float:
    """The workload's optimizer step's memory traffic per parameter over AdamW's, on which the step
    models' optimizer rates rest (the GPU's counted, the CPU's and the offloading host's measured):
    an elementwise step reads the fp32 parameter, its gradient and its state and writes the
    parameter and the state, 12 + 2 x state B (AdamW's 8 B of state: 28 B; SGD with momentum 20,
    without 12). Derived from the profile's state bytes (the plan sets the goal's optimizer on a
    profile that names none; here such a profile counts as AdamW), not measured per optimizer."""
    state = optimizer_state_bytes(profile, "adamw")[0]
    return (2 * MASTER_PARAM_BYTES + GRAD_BYTES + 2 * state) / (2 * MASTER_PARAM_BYTES + GRAD_BYTES
                                                                 + 2 * OPTIMIZER_STATE_BYTES["adamw"])


def estimate_memory(profile: ModelProfile, strategy: Strategy, *, micro_batch: int, world_size: int,
                    shard_group_size: int, device: str, optimizer: str = "adamw") -> MemoryEstimate:
    """Predicted peak memory of one rank (every term counted: the module docstring).

    `optimizer` is assumed only when the profile does not name the workload's own.
    `shard_group_size` is the number of ranks that share one copy of the model state: 1 for DDP,
    `world_size` for fsdp_full / fsdp_grad_op, devices per node for hybrid (zero1 shards its
    optimizer state over all `world_size` ranks whatever it is). `device`: the Topology's."""
    p = float(profile.num_params)
    c = COMPUTE_DTYPE_BYTES[strategy.precision]
    opt_b, opt_source = optimizer_state_bytes(profile, optimizer)
    g = max(1, shard_group_size if strategy.shards_params else 1)
    tp = strategy.tp  # 1 for DDP and zero1 (Strategy refuses them tp > 1)
    mixed = strategy.precision != "fp32"
    notes = [f"fp32 params {MASTER_PARAM_BYTES} + fp32 grads {GRAD_BYTES} + {opt_source} state "
             f"{opt_b:g} = {MASTER_PARAM_BYTES + GRAD_BYTES + opt_b:g} B/param"]

    # x / 1 is exact: tp = 1 keeps every term bit-for-bit what it was before TP existed
    # the loss gradient over the vocabulary: whole where a TP plan gathers the logits on every
    # rank, 1/tp of it where the plan keeps them split (loss parallel)
    transient = transient_bytes(profile, strategy, micro_batch) / (tp if profile.tp_loss_parallel else 1)
    activations = activation_bytes(profile, strategy, micro_batch, device=device) / tp + transient
    factor, input_factor = activation_factors(strategy, profile)
    act_note = (f"activations x{factor:g} of the fp32 measurement "
                + (f"({strategy.precision} params)" if strategy.shards_params else "(autocast)")
                if mixed else "activations as measured (fp32)")
    if strategy.compile:
        act_note += f", x{compile_factor(profile, strategy):g} compiled (Inductor recomputes pointwise work)"
    elif device == "cpu" and profile.math_attention_bytes_per_sample > 0:
        act_note += (", attention with dropout on SDPA's math path (CPU): "
                     f"{fmt_gib(profile.math_attention_bytes_per_sample)} GiB a sample more")
    if mixed and profile.attention_scores_bytes_per_sample > 0:
        plain, upcast = scores_factors(strategy, profile, device)
        held = upcast if profile.attention_scores_upcast_bytes_per_sample > 0 else plain
        act_note += f", attention written out: its scores x{held:g} (the dtype its softmax ran in)"
    if strategy.recomputes:
        act_note += f", {describe(strategy.checkpointing)} (block inputs x{input_factor:g})"
    units = 0.0  # FSDP unsharded parameters/gradients, counted in overhead

    if not strategy.shards_params:
        params, grads, opt = MASTER_PARAM_BYTES * p, GRAD_BYTES * p, opt_b * p
        if strategy.kind == "zero1" and world_size > 1:
            opt /= world_size
            notes[0] += f"; optimizer state / {world_size} (ZeRO-1), the updated parameters all-gathered in place (0 B)"
        if mixed:
            # autocast's weight cache: one compute-dtype copy of every weight, freed after backward
            activations += c * p
            notes.append(f"autocast weight cache {c} B/param (in activations)")
        if world_size == 1:
            # the peak is max(activations + part of the grads, grads + optimizer temporaries);
            # keep the terms additive by charging the grads term with what exceeds activations
            # an optimizer without state (plain SGD) updates in place: no temporaries
            temps = FOREACH_ADAMW_TEMP_FACTOR * MASTER_PARAM_BYTES * p if device == "cpu" and opt_b > 0 else 0.0
            # backward's transient (in `activations`) comes before most gradients exist
            grads = max(SINGLE_PROCESS_GRAD_OVERLAP * grads - transient, grads + temps - activations, 0.0)
            notes.append("one process: grads freed each step, peak = max(activations + half the grads, activations + "
                         "backward transient, grads + optimizer-step temporaries)")
        if world_size > 1:  # runtime/wrap.py builds DDP with gradient_as_bucket_view=True: no bucket copy
            notes.append("DDP buckets 0 extra (gradient_as_bucket_view=True)")
    else:
        # TP splits every weight t ways, then FSDP shards each slice over its G ranks
        params, grads, opt = (b * p / tp / g for b in (MASTER_PARAM_BYTES, GRAD_BYTES, opt_b))
        notes[0] += f" / {g} (sharded)" if tp == 1 else f" / (TP {tp} x FSDP {g})"
        block = float(largest_unit_params(profile, strategy)) / tp
        unit = "block" if strategy.fsdp_unit == "block" else "linear-layer unit"
        root = float(unsharded_root_params(profile)) / tp
        if strategy.kind == "fsdp_grad_op":
            # reshard_after_forward=False: every unit stays unsharded from forward to backward
            units += c * p / tp
            notes.append(f"unsharded {strategy.precision} params {c} B/param (grad-op keeps them)")
        else:
            units += c * (root + 2 * block)
            notes.append(f"unsharded root ({root / 1e6:.0f}M params, kept from forward) + 2 {unit}s (prefetch) at "
                         f"{c} B" + (f", each its TP 1/{tp} (embedding row-, head column-split)"
                                     if tp > 1 else ""))
        # one unit's grads (compute dtype) and the reduce-scatter input foreach_reduce copies them into: that comes once
        # the unit's backward freed its share of the saved (or recomputed) activations, and adds what exceeds it
        whole = dataclasses.replace(strategy, checkpointing="none")
        freed = activation_bytes(profile, whole, micro_batch, device=device) / tp / max(
            1, profile.num_blocks * units_per_block(profile, strategy))
        units += c * block + max(0.0, strategy.reduce_bytes * block - freed)
        notes.append(f"one {unit}'s {strategy.precision} grads + {strategy.reduce_dtype} reduce-scatter input "
                     "past its activations")
        # backward's transient peaks before any block's unit is unsharded again (module docstring): the peak
        # holds the larger; what stays unsharded from forward (grad-op: all, else the root) lives beside it
        coexisting = c * p / tp if strategy.kind == "fsdp_grad_op" else c * root
        overlap = min(units - coexisting, transient)
        if overlap > 0:
            units -= overlap
            notes.append(f"the unsharded units and backward's transient never live at once: "
                         f"{fmt_gib(overlap)} GiB counted once")
        if strategy.offload and device == "cuda":
            # FSDPParam.all_gather_inputs copies the prefetched unit's fp32 shard to the GPU before casting it
            # into the all-gather input: a 7B model on one H200 peaked 0.70 GiB past the plan, a block being 0.75
            units += MASTER_PARAM_BYTES * block / g
            notes.append(f"CPU offload: the prefetched {unit}'s fp32 shard copied in ({MASTER_PARAM_BYTES} B/param)")
        if tp > 1:
            notes.append(f"TP {tp} + sequence parallelism: activations / {tp} (every activation "
                         "split, Korthikanti et al. 2022); the loss gradient "
                         + (f"/ {tp} (logits split over the vocabulary: loss parallel)" if profile.tp_loss_parallel
                            else "whole (logits gathered, no loss parallel)")
                         + "; norm weights replicated (negligible)")
    if transient > 0:
        act_note += (f"; backward transient {fmt_gib(transient)} GiB ("
                     + ("the fused loss's saved logits and their gradient at the compute dtype"
                        if fused_loss_bytes(profile, strategy) else "the loss gradient, measured on meta")
                     + ") in activations")
    notes.append(act_note)

    host = 0.0
    if strategy.offload and device == "cuda":
        # the shard's fp32 params, grads and optimizer state move to pinned host memory
        host, params, grads, opt = params + grads + opt, 0.0, 0.0, 0.0
        notes.append(f"CPU offload: the shard's params, grads and optimizer state in host memory "
                     f"({fmt_gib(host)} GiB per rank), none on the GPU")
    state = params + grads + opt + activations + units
    overhead = units
    if device == "cuda":
        state += CUBLAS_WORKSPACE_BYTES
        overhead += CUBLAS_WORKSPACE_BYTES + CUDA_CONTEXT_BYTES + CUDA_ALLOCATOR_SLACK * state
        if world_size > 1:
            overhead += NCCL_BUFFER_BYTES
        notes.append(f"cuBLAS workspaces {CUBLAS_WORKSPACE_BYTES / 1024**2:.0f} MiB"
                     f" + CUDA context {CUDA_CONTEXT_BYTES / GIB:.2g} GiB"
                     + (f" + NCCL {NCCL_BUFFER_BYTES / GIB:.2g} GiB" if world_size > 1 else "")
                     + f" + allocator slack {CUDA_ALLOCATOR_SLACK:.0%}")
    else:
        notes.append("CPU: no context or allocator overhead counted")
    est = MemoryEstimate(params_bytes=params, grads_bytes=grads, optimizer_bytes=opt,
                         activations_bytes=activations, overhead_bytes=overhead,
                         assumptions="; ".join(notes), host_bytes=host)
    logger.debug("memory %s %s mb=%d G=%d: %.2f GiB", strategy.kind, strategy.precision, micro_batch, g, est.total_gib)
    return est


def fmt_gib(nbytes: float) -> str:
    """Bytes as GiB with one decimal (three significant digits below 1 GiB)."""
    gib = nbytes / GIB
    return f"{gib:.1f}" if gib >= 1 or gib == 0 else f"{gib:.2g}"


__all__ = ["estimate_memory", "optimizer_state_bytes", "optimizer_step_share", "usable_mem_bytes",
           "unsharded_root_params", "fmt_gib",
           "MASTER_PARAM_BYTES", "GRAD_BYTES", "OPTIMIZER_STATE_BYTES",
           "DDP_BUCKET_CAP_BYTES", "CUDA_CONTEXT_BYTES", "CUBLAS_WORKSPACE_BYTES", "NCCL_BUFFER_BYTES",
           "CUDA_ALLOCATOR_SLACK", "SINGLE_PROCESS_GRAD_OVERLAP", "FOREACH_ADAMW_TEMP_FACTOR"]

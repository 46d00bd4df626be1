"""Step-time model: compute by kind of work, communication from the alpha-beta model.

Pure arithmetic on the frozen specs: no torch, no I/O; never imports cli, backends, jobs, runtime,
results or report.

One micro-batch's forward on a GPU is the sum of three kinds of work, each at its own rate:
- matmuls (the profile's FLOPs minus attention) at the dtype's peak x a matmul efficiency that
  rises with the GEMM's size: the architecture's best large-GEMM fraction (MAMF), times
  w/(w + GEMM_HALF_WIDTH) for model width w and t/(t + GEMM_HALF_TOKENS) for t tokens per
  micro-batch: narrow models and short micro-batches run far below peak;
- attention (causal: half the profiled 4 s^2 d FLOPs per block) at the rate the profile's
  `attention_kernel` reaches at that sequence length on that architecture (`attention`); written
  out ("eager"), all of them as narrow matmuls;
- memory-bound work (norms, activations, residual adds, casts, rotary, loss) proportional to the
  activation bytes the forward saves, over the HBM bandwidth (`hbm`; MEMORY_PASSES round trips per
  saved byte, fewer with torch.compile; a fused loss and low-precision norms by their constants).
A language model's output head runs at a wide GEMM's efficiency whatever the model's width.
No step is shorter than the host takes to launch its ops (HOST_OP_S each, eager).
Backward is twice the forward (flash attention's 2.5x the FLOPs, at its kernel's backward rate:
the forward+backward rate split by `attention.ATTENTION_FWD_OVER_BWD`); checkpointing recomputes a share of the
forward inside backward, by mode (`checkpointing`: every block all of it, 4/3 the compute; every
other block half; per-op selective the memory-bound work and every second matmul, priced on
this forward's split). The optimizer step streams fp32 params, grads and the optimizer's state
through HBM once (`memory.optimizer_step_share`: AdamW's 28 B a parameter, SGD's fewer);
offloaded (`offload`), it runs on the host after the shard's copies over its link.

Communication (collectives.py) hides behind compute but is not free: NCCL's kernels take SMs and
HBM bandwidth from the matmuls they overlap, so every hidden second costs CONTENTION seconds of
compute; what compute cannot hide (the first all-gather of a forward, the last reduce-scatter of
a backward, traffic beyond the phase) is exposed. Every collective synchronises the ranks, so the
step waits for the slowest: with per-step jitter of coefficient of variation STEP_JITTER the
expected maximum over N ranks is sqrt(2 ln N) standard deviations above the mean.

CPU ranks have their own model (`cpu_cost`: the probe's per-core rates shared among the ranks
and threads, gloo communication that overlaps nothing); `step_time` hands CPU devices (no
compute capability) to it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from launcher.hardware.types import DeviceSpec, Topology
from launcher.plan.activations import COMPUTE_DTYPE_BYTES, logits_bytes
from launcher.plan.attention import ATTENTION_BWD_FACTOR, EAGER_HEAD_DIM, attention_efficiency, forward_share
from launcher.plan.checkpointing import recompute_share as mode_recompute
from launcher.plan.collectives import ddp_comm, dp_topology, sharded_comm, tp_comm_s, zero1_sync_s
from launcher.plan.cpu_cost import ADAMW_FIXED_OPS, BACKWARD_OVERHEAD_FACTOR, cpu_forward, cpu_step_time
from launcher.plan.float8 import float8_terms, gemm_speedup
from launcher.plan.gemm import attention_flops_fwd, gemm_efficiency, head_flops_fwd, model_width, peak_flops
from launcher.plan.hbm import hbm_bytes_per_s
from launcher.plan.memory import optimizer_step_share
from launcher.plan.offload import offload_s
from launcher.plan.step_probe import WorkloadTiming, timing_key
from launcher.plan.types import StepTimeEstimate
from launcher.specs import CUDA_GRAPH_MODES, ModelProfile, Strategy

# --- GPU compute -----------------------------------------------------------------------------
# HBM round trips per byte of saved activations for the memory-bound work of one forward (eager
# PyTorch runs each norm, activation, residual add, cast and rotary as separate kernels that read
# and write whole activations). Measured, not fitted (docs/benchmarks.md, the step by kind of
# work, one H100: GPT-2 small, DDP bf16 autocast eager, whose norms and loss run as the defaults
# "eager" price them: memory-bound kernels 0.145 s a step against 0.150 s predicted at 5 passes,
# i.e. 4.8; taken as 5, the earlier fit's value). Fitted freely on the published rows it rises to
# 6 and beyond (the grid's edge): the large models' steps are slower than their matmuls and
# attention explain, and the per-byte term absorbs it; that contradicts this measurement (6
# would price its memory-bound work 24% over the measured) and overprices the small models'
# steps that are mostly elementwise (the <= 1k band of benchmarks/published).
MEMORY_PASSES = 5.0
# The loss over the vocabulary by kernel (the profile's `loss_kernel`). "eager" (F.cross_entropy:
# under autocast an fp32 cast of the logits, log_softmax, nll_loss and their backwards, each a
# pass over a logits-sized tensor) is priced with the rest, MEMORY_PASSES per byte saved: the
# profile saves log_softmax's fp32 output. "fused" (flash-attn's CrossEntropyLoss,
# flash_attn/ops/triton/cross_entropy.py, llm-foundry's default `loss_fn: fused_crossentropy`)
# is one Triton kernel each way that saves only the log-sum-exp per token: forward reads the
# compute-dtype logits once; backward (twice the forward, as everywhere here) reads them once and
# writes their gradient once. Counted from the kernel's code, not fitted.
FUSED_LOSS_PASSES = 1.0
# Norms by kernel (the profile's `norm_kernel`). "eager": as autocast runs layer_norm (its fp32
# op list; torchtitan's and fms' RMSNorm upcast by hand, more passes still): the compute-dtype
# input cast up (2 + 4 B an element in bf16), the norm in fp32 (4 + 4), its fp32 output cast down
# by the next matmul (4 + 2): 20 B; priced with the rest, in MEMORY_PASSES. "low-precision"
# (llm-foundry's LPLayerNorm, `norm_type: low_precision_layernorm`: layer_norm with autocast off
# on the compute-dtype input; the residual stream is bf16 since Composer 0.16's FSDP "DEFAULT"
# mixed precision gathers bf16 parameters) reads and writes it once: 4 B. So its forward moves
# NORM_AUTOCAST_BYTES fewer per element of each norm's input (a pre-norm block's two and the
# final norm); none in fp32, where nothing is cast. Counted from the code, not fitted.
NORM_AUTOCAST_BYTES = 16.0
# torch.compile fuses those elementwise chains into fewer kernels: the share of the eager traffic
# that remains. FIT (see GEMM_HALF_WIDTH), resting on the 10 rows with compile (torchtitan 8B
# on 8/128 H100 eager vs compile: +16%; IBM Llama 2 7B-70B).
COMPILE_MEMORY_FACTOR = 0.6
# AdamW step per parameter of the local shard: read fp32 param, grad, m, v (16 B), write param,
# m, v (12 B); a memory-bound kernel (fused or foreach).
OPTIMIZER_BYTES_PER_PARAM = 28
# Host seconds to issue one aten op to a GPU in eager PyTorch: Python, the dispatcher, autograd and
# cudaLaunchKernel run before its kernel does, and the GPU idles where the host is slower (a small
# model's step is the host's). PyTorch's autoparallel cost model charges every op at least 7 us on
# H100 (meta-pytorch/autoparallel#146); an eager add issued back to back costs 8 us of host time on
# A100. An ASSUMPTION for the GPU host, on every aten op the profile counts (views too, which cost
# less: the high side), counted like the CPU model's ops (cpu_cost: the backward
# BACKWARD_OVERHEAD_FACTOR x the forward's, the optimizer ADAMW_FIXED_OPS foreach launches, none
# offloaded); compiled, Inductor launches COMPILE_MEMORY_FACTOR of the model's (it fuses their kernels
# as their traffic), and a mode that replays CUDA graphs none.
HOST_OP_S = 8e-6
HOST_OP_RANGE_S = (4e-6, 12e-6)  # where it may lie (views cost less, module hooks more): the plan's interval
LAUNCH_WAIT_PART = "waiting for launches"  # the compute part the launches add where they set the step

# --- overlap -----------------------------------------------------------------------------------
# Share of a compute phase communication can hide behind. CUDA: NCCL runs on its own stream
# for the whole phase; its cost is in CONTENTION instead (CPU ranks hide nothing: `cpu_comm`).
OVERLAP_EFFICIENCY = {"cuda": 1.0}
# Compute seconds lost per second of communication hidden behind it: NCCL's ring kernels occupy
# up to 16-32 of the GPU's SMs and stream every byte through HBM (nccl-tests #212). FIT (see
# GEMM_HALF_WIDTH), resting mostly on the MPT rows whose accumulation re-gathers all weights
# per micro-batch and on IBM's 400 Gb/s cluster.
CONTENTION = {"cuda": 0.15}
# Coefficient of variation of one rank's step time (clock and power throttling, the host, network
# jitter). FIT (see GEMM_HALF_WIDTH), resting on the 4 published scaling series (8 -> 64/128 GPUs).
STEP_JITTER = {"cuda": 0.006}
# Beyond one tier of leaf (rail) switches, a job's collectives cross the fabric's spine: more
# hops, ECMP collisions, and ever more ranks for the slowest to be among (the expected maximum of
# N exponential-tailed delays grows as ln N). Published: the llm-foundry H100 tables lose 0-2.7%
# of per-GPU throughput from 8 to 64/128 GPUs (MPT-13B, torchtitan Llama 3.1 8B) but 2.5-9.7%
# from 128 to 512 (MPT-1B ... 70B, 6 series: ~2-5% per doubling). FIT on those series (the only
# published 512-GPU data-parallel runs, one cluster): every doubling of nodes beyond
# LEAF_NODES adds SCALE_TAX of the step; 16 nodes and 2.2% put all 10 published scaling series
# within 2.4 points (docs/benchmarks.md). An assumption outside that range.
LEAF_NODES = 16
SCALE_TAX = {"cuda": 0.022}


@dataclass(frozen=True, kw_only=True)
class ForwardPass:
    """Seconds of one micro-batch's forward on one device, by kind of work."""

    gemm_s: float
    attention_s: float
    memory_s: float
    attention_bwd_s: float  # attention's backward (its FLOPs 2.5x the forward's, at its own rate)

    @property
    def total_s(self) -> float:
        """All three."""
        return self.gemm_s + self.attention_s + self.memory_s

    @property
    def backward_s(self) -> float:
        """Backward: twice the matmuls and memory traffic, and attention's backward."""
        return 2 * (self.gemm_s + self.memory_s) + self.attention_bwd_s


def forward_pass(profile: ModelProfile, strategy: Strategy, micro_batch: int, device: DeviceSpec) -> ForwardPass:
    """One micro-batch's forward on GPU `device`, by kind of work (see the module docstring).

    The output head runs at a wide GEMM's efficiency: its N is the vocabulary, and two of its
    three GEMMs (the input gradient, reducing over the vocabulary, and the weight gradient, over
    the tokens) have no short side but their output's width (measured, docs/benchmarks.md GPU
    acceptance run 4, GPT-2 small with a 50k vocabulary on one H100: its matmuls, a third of them
    the head, ran 1.3x faster than all priced at the 768-wide blocks' efficiency). Tensor
    parallelism of degree t = `strategy.tp` (with sequence parallelism) narrows each rank's
    matmuls to width / t and gives it 1/t of the matmul FLOPs, of the attention heads and of the
    memory-bound work (run on 1/t of the sequence). x / 1 is exact: tp = 1 is unchanged."""
    tp = strategy.tp
    peak = peak_flops(device, strategy.precision)
    attn = attention_flops_fwd(profile)
    tokens = micro_batch * profile.units_per_sample
    full_width = model_width(profile)
    width = None if full_width is None else full_width / tp
    head = min(head_flops_fwd(profile), profile.flops_fwd_per_sample - attn)
    # float8: the converted share of the blocks' matmuls at float8's rate, plus its casts
    converted, casts = float8_terms(profile, strategy, micro_batch, device)
    body = profile.flops_fwd_per_sample - attn - head
    gemm = (body * (1 - converted + converted / gemm_speedup())
            / gemm_efficiency(device, width, tokens, strategy.precision)
            + head / gemm_efficiency(device, math.inf, tokens, strategy.precision)
            ) / tp * micro_batch / peak
    if profile.attention_kernel == "eager":  # all the profiled FLOPs as matmuls, backward twice them
        attention = attn / tp * micro_batch / peak / gemm_efficiency(device, EAGER_HEAD_DIM, tokens, strategy.precision)
        attention_fwd_bwd = 3 * attention
    else:  # causal: half the profiled FLOPs, at the curve's forward+backward rate, split by kernel
        attention_fwd_bwd = (1 + ATTENTION_BWD_FACTOR) * 0.5 * attn / tp * micro_batch / (
            peak * attention_efficiency(device, profile.units_per_sample, profile.attention_kernel))
        attention = attention_fwd_bwd * forward_share(profile.attention_kernel)
    passes = MEMORY_PASSES * (COMPILE_MEMORY_FACTOR if strategy.compile else 1.0)
    # the profile measured fp32 tensors; the traffic moves at the compute dtype (whatever
    # autocast keeps in fp32 is small next to the matmul inputs and outputs)
    to_compute_dtype = COMPUTE_DTYPE_BYTES[strategy.precision] / COMPUTE_DTYPE_BYTES["fp32"]
    saved, loss = profile.activation_bytes_per_sample, 0.0
    logits = min(logits_bytes(profile), saved)
    if profile.loss_kernel == "fused":
        # the fused loss saves no log_softmax output: its logits priced by its own passes
        saved, loss = saved - logits, FUSED_LOSS_PASSES * logits
    elif strategy.compile:
        # runtime.compiling compiles the model's forward; the workload's loss_fn takes the loss of its logits
        # outside it, unfused (GPT-2 small, a fifth of its saved bytes: compile measured 1.15-1.21x over eager on
        # an H100 and an H200, 1.29x priced when they were fused too)
        saved, loss = saved - logits, MEMORY_PASSES * logits
    # compile fuses float8's amax and cast passes with their neighbours as it does the rest
    traffic = (passes * saved + loss) / tp * micro_batch * to_compute_dtype + casts * passes / MEMORY_PASSES / tp
    if profile.norm_kernel == "low-precision" and full_width is not None and strategy.precision != "fp32":
        # the norms' fp32 round trips autocast would add, not run (a pre-norm transformer)
        norm_elements = (2 * profile.num_blocks + 1) * full_width * tokens / tp
        traffic = max(0.0, traffic - NORM_AUTOCAST_BYTES * norm_elements)
    return ForwardPass(gemm_s=gemm, attention_s=attention, attention_bwd_s=attention_fwd_bwd - attention,
                       memory_s=traffic / hbm_bytes_per_s(device))


def _recompute(strategy: Strategy, profile: ModelProfile, matmul_s: float, attention_s: float,
               memory_bound_s: float) -> float:
    """Share of the forward that backward runs again: the strategy's checkpointing mode priced
    on the forward's split by kind of work (`checkpointing.recompute_share`; none: 0). Attention
    written out is bmm and softmax, which no save list keeps: recomputed as memory-bound work is."""
    if profile.attention_kernel == "eager":
        attention_s, memory_bound_s = 0.0, memory_bound_s + attention_s
    return mode_recompute(strategy.checkpointing, num_blocks=profile.num_blocks, matmul_s=matmul_s,
                          attention_s=attention_s, memory_bound_s=memory_bound_s)


def compute_s(profile: ModelProfile, strategy: Strategy, micro_batch: int, grad_accum: int,
              device: DeviceSpec) -> float:
    """Compute time of `grad_accum` micro-batches on one GPU (no optimizer step): forward,
    backward, and the recomputed share of the forward with checkpointing. CPU ranks depend on
    how many share the host: `cpu_cost.cpu_forward`."""
    fwd = forward_pass(profile, strategy, micro_batch, device)
    recompute = _recompute(strategy, profile, fwd.gemm_s, fwd.attention_s, fwd.memory_s)
    return (fwd.total_s * (1 + recompute) + fwd.backward_s) * grad_accum


def optimizer_s(profile: ModelProfile, group_size: int, device: DeviceSpec) -> float:
    """The optimizer step over this rank's shard of the parameters on a GPU, at AdamW's bytes scaled
    to the workload's optimizer (`memory.optimizer_step_share`; CPU: `cpu_cost.cpu_optimizer_s`)."""
    local = profile.num_params / max(1, group_size)
    return OPTIMIZER_BYTES_PER_PARAM * optimizer_step_share(profile) * local / hbm_bytes_per_s(device)


def shard_group_size(kind: str, topology: Topology, tp: int = 1) -> int:
    """Ranks that share one copy of the model state (of one TP slice, with tensor parallelism
    of degree `tp`): 1 (DDP), a node's ranks / tp (hybrid), all ranks / tp (FSDP; zero1's
    optimizer state, what the optimizer steps)."""
    return {"ddp": 1, "hybrid": topology.devices_per_node // tp}.get(kind, topology.world_size // tp)


def step_time(profile: ModelProfile, strategy: Strategy, topology: Topology, micro_batch: int,
              grad_accum: int, *, timing: WorkloadTiming | None = None) -> StepTimeEstimate:
    """Predicted time of one optimizer step (grad_accum micro-batches) on one rank.

    - ddp: one all-reduce of the fp32 grads per step in 25 MiB buckets (no_sync during
      accumulation), hidden behind the last micro-batch's backward except the final bucket.
    - zero1: ddp's all-reduce, then the parameter sync after the optimizer step, exposed
      (`collectives.zero1_sync_s`); the optimizer steps params / world.
    - fsdp_full, fsdp_grad_op, hybrid: per micro-batch all-gathers at the compute dtype (full
      shard gathers again in backward, the root unit excepted; grad-op keeps the forward's) and
      reduce-scatters of fp32 grads (`collectives.sharded_comm`); the first gather of a forward
      and the last reduce-scatter of a backward have nothing to hide behind. Hybrid adds one
      all-reduce of each rank's 1/G grad shard across nodes per step (the runtime disables it on
      all but the last micro-batch).
    - tensor parallelism (`strategy.tp` = t > 1, FSDP kinds only): compute as `forward_pass`
      narrows it, FSDP's traffic over the data-parallel group (`dp_topology`), and per
      micro-batch TP + SP's activation collectives over NVLink (`collectives.tp_comm_s`), all
      exposed (no async TP). The optimizer steps params / (t x shard group).
    Hidden communication costs CONTENTION of its time in compute; the whole step is stretched by
    the expected wait for the slowest of the ranks (STEP_JITTER), and beyond LEAF_NODES nodes
    by SCALE_TAX per doubling of nodes (the fabric's spine). CPU ranks: `cpu_cost.cpu_step_time`,
    with the workload's own timed steps (`timing`) when the planning host measured them."""
    device, kind, n = topology.accelerator, topology.device, topology.world_size
    if device.compute_capability is None:
        key = timing_key(strategy.precision, strategy.kind, profile.batch_norms)
        measured = None if timing is None else (timing.precisions.get(key) or timing.precisions.get(strategy.precision))
        recompute = 0.0
        if strategy.recomputes:
            # selective saves matmul and attention outputs: convolutions and casts are recomputed
            cpu = cpu_forward(profile, strategy, micro_batch, topology)
            recompute = _recompute(strategy, profile, cpu.gemm_s, cpu.attention_s,
                                   cpu.memory_s + cpu.conv_s + cpu.cast_s)
        return cpu_step_time(profile, strategy, topology, micro_batch, grad_accum,
                             group_size=shard_group_size(strategy.kind, topology, strategy.tp),
                             recompute=recompute, timing=measured)
    fwd = forward_pass(profile, strategy, micro_batch, device)
    fwd_s = fwd.total_s
    recompute = _recompute(strategy, profile, fwd.gemm_s, fwd.attention_s, fwd.memory_s)
    bwd_s = fwd.backward_s + recompute * fwd_s
    # the optimizer steps this rank's shard of its TP slice: params / (tp x shard group), on
    # the GPU, or offloaded on the host after the shard's copies over the host link
    group = shard_group_size(strategy.kind, topology, strategy.tp)
    link_total, link_exposed, opt = (
        offload_s(profile, strategy, topology, group, fwd_s, bwd_s, grad_accum) if strategy.offload
        else (0.0, 0.0, optimizer_s(profile, strategy.tp * group, device)))
    compute = grad_accum * (fwd_s + bwd_s) + opt
    # each kind's forward, the mode's recomputed share of that kind, and its own backward
    again = [grad_accum * (1 + _recompute(strategy, profile, *kind)) for kind in ((1, 0, 0), (0, 1, 0), (0, 0, 1))]
    parts: tuple[tuple[str, float], ...] = (
        ("matmul", fwd.gemm_s * (again[0] + 2 * grad_accum)),
        ("attention", fwd.attention_s * again[1] + fwd.attention_bwd_s * grad_accum),
        ("memory-bound", fwd.memory_s * (again[2] + 2 * grad_accum)),
        ("host optimizer" if strategy.offload else "optimizer", opt))
    fused = (0.0 if strategy.compile_mode in CUDA_GRAPH_MODES else COMPILE_MEMORY_FACTOR) if strategy.compile else 1.0
    ops = profile.forward_ops * (1 + recompute + BACKWARD_OVERHEAD_FACTOR) * grad_accum * fused + (
        0.0 if strategy.offload else ADAMW_FIXED_OPS)
    host = ops * HOST_OP_S + (opt if strategy.offload else 0.0)  # the host's optimizer after its launches
    if profile.forward_ops and host > compute:  # the GPU waits for the host's launches (HOST_OP_S)
        parts, compute = (*parts, (LAUNCH_WAIT_PART, host - compute)), host
    if n <= 1:
        return StepTimeEstimate(compute_s=compute, comm_total_s=link_total,
                                comm_exposed_s=link_exposed, compute_parts=parts)
    ovl = OVERLAP_EFFICIENCY[kind]
    if not strategy.shards_params:
        total, exposed = ddp_comm(profile, strategy, topology, bwd_s * ovl)
        sync = zero1_sync_s(profile, topology) if strategy.kind == "zero1" else 0.0
        total, exposed = total + sync, exposed + sync
    else:
        total, exposed = sharded_comm(profile, strategy, dp_topology(topology, strategy.tp),
                                       fwd_s * ovl, bwd_s * ovl, grad_accum)
    if strategy.tp > 1:
        # TP's activation collectives wait on the matmuls they feed (exposed: no async TP), re-run with them
        tp_s = grad_accum * tp_comm_s(profile, strategy, topology, micro_batch,
                                      recompute=_recompute(strategy, profile, 1.0, 0.0, 0.0))
        total, exposed = total + tp_s, exposed + tp_s
    contention = CONTENTION[kind] * max(0.0, total - exposed)  # of the hidden communication
    # the host link's copies (offload) take no SMs: no contention
    total, exposed = total + link_total, exposed + link_exposed
    busy = compute + exposed + contention
    sync = (STEP_JITTER[kind] * math.sqrt(2 * math.log(n))
            + SCALE_TAX[kind] * max(0.0, math.log2(topology.num_nodes / LEAF_NODES))) * busy
    return StepTimeEstimate(compute_s=compute, comm_total_s=total, comm_exposed_s=exposed,
                            contention_s=contention, sync_wait_s=sync, compute_parts=parts)


"""Step-time model of training on CPU processes (gloo), from what the probes measured on this host.

Pure arithmetic on the frozen specs: no torch, no I/O; never imports cli, backends, jobs, runtime,
results or report (`cpu_probe` and `gloo_probe` measure the rates in `cpu_rates`; this uses them).

Each rank runs max(1, cores // ranks) OpenMP threads (the launcher's OMP_NUM_THREADS); with more
ranks than cores the ranks time-share the cores, so a rank gets cores/ranks of one. Its rates
are the probe's single-thread rates times the speedup the probe measured on this host at the
rank's threads for that kind of work (`cpu_rates.core_share`: the large GEMM's for matmuls,
attention and convolutions, the in-cache streaming add's for memory-bound work and casts; a
2-core host without SMT reads ~2x and ~1.6x where one with SMT siblings reads less). One
micro-batch's forward is the sum of:
- matmuls: the profile's FLOPs less attention and convolutions, at the dtype's large-GEMM
  rate x rows/(rows + half_rows), rows being how often each weight is reused per micro-batch
  (FLOPs / 2 x params: the micro-batch for an MLP, tokens for a transformer);
- attention and convolutions at the rates the probe measured for them (forward, and backward
  as a multiple of it: the CPU flash kernel's bf16 backward is far slower than its fp32 one);
- memory-bound work (activations, norms, residuals, the loss): ACTIVATION_PASSES streams of the
  saved activations at the compute dtype, and one of the weights, at the probe's bandwidth for
  the working set (`stream_s`: the cache the rank keeps beside the node's other ranks);
- low precision's casts: autocast (DDP) casts every weight to bf16 in each forward and its
  gradient back to fp32 in backward; FSDP's MixedPrecisionPolicy casts the local shard at each
  all-gather and the unsharded gradient to fp32 for its reduce-scatter.
Backward is twice the forward's matmuls and memory traffic (attention and convolutions: their
measured factors), plus writing (or accumulating) the fp32 gradient of every parameter; the
optimizer streams OPTIMIZER_BYTES_PER_PARAM per local parameter (AdamW's; another optimizer's scaled by
`memory.optimizer_step_share`, which over-prices SGD's few passes). On top comes the fixed cost of
every operation (Python, the dispatcher, autograd), which dominates a tiny model: the profile's
forward ops at the probe's per-op cost, the backward as a multiple of that, the AdamW step per
parameter tensor and the harness's per-step work; one thread runs it, so more threads do not speed
it up: time-sharing a core slows it, and so does the rank's OpenMP team where the probe measured its
chain of tiny ops slower on the rank's threads (`cpu_rates.op_share`). Communication and FSDP's own
work: `cpu_comm`, added to the step (gloo's threads need the cores compute uses: nothing hides).
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.hardware.types import Topology
from launcher.plan.activations import COMPUTE_DTYPE_BYTES
from launcher.plan.cpu_comm import cpu_ddp_comm, cpu_sharded_comm, cpu_zero1_sync, fsdp_overhead_s
from launcher.plan.cpu_rates import core_share, gloo_of, op_share, rates_of, time_share
from launcher.plan.memory import GRAD_BYTES, MASTER_PARAM_BYTES, optimizer_state_bytes, optimizer_step_share
from launcher.plan.step_probe import StepTiming
from launcher.plan.types import StepTimeEstimate
from launcher.specs import ModelProfile, Strategy

# Streams of the saved activations (compute dtype) through memory per forward: write the activation,
# read it for the next op, plus norms, GELU/ReLU, residual adds and the loss. Calibrated on
# single-thread timings (CPU time, best of 12, OMP_NUM_THREADS=1) of workloads/resnet.py (batch norm
# + ReLU heavy) and gpt.py tiny forwards at micro-batch 8 against their matmul time from the probe.
ACTIVATION_PASSES = 3.0
# Bytes moved per parameter by one backward besides its matmuls: read the fp32 gradient and
# write it back (autograd accumulates into .grad; a fresh .grad is zero-filled), and read the
# weight for the input gradient.
GRAD_TRAFFIC_BYTES = 2 * GRAD_BYTES + 4
# torch.optim.AdamW (single-tensor on CPU: foreach kernels are CUDA-only) runs ~10 separate
# passes over param, grad, m, v and temporaries (lerp, mul, addcmul, sqrt, div, add, addcdiv,
# weight decay): about 80 bytes per parameter. Single-thread timings of workloads/mlp.py
# (0.92M params: 5.3 ms) and gpt.py tiny (4.46M: 30-68 ms) against the probe's bandwidth.
OPTIMIZER_BYTES_PER_PARAM = 80
# Bytes of one cast between fp32 and bf16: read 4, write 2 (or the reverse).
CAST_BYTES_PER_PARAM = 6
# Per-op overhead, in multiples of the probe's 1-element add. Calibrated with single-thread
# timings (best of 30, OMP_NUM_THREADS=1, torch 2.13, 2-core VM) of the 7-op model of
# tests/data/fp16_overflow.py at micro-batch 8 (GEMMs of a few hundred FLOPs: all overhead):
# - a forward op costs 1.5-2.3 graph-building adds (nn.Module calls and F.linear's argument
#   handling come on top of the aten op): 1.9;
# - the backward after the engine's start-up costs 2.3-2.5x the forward (addmm's backward is
#   two mms and a sum, plus one AccumulateGrad per parameter tensor): 2.4;
OP_COST_SCALE = 1.9
BACKWARD_OVERHEAD_FACTOR = 2.4
# - torch.optim.AdamW on CPU runs its single-tensor path (foreach is the default on CUDA only):
#   ~10 aten ops and a Python loop per parameter tensor. Stepping 4 and 32 1-element
#   parameters took 7.4-13 adds' worth per tensor and 25-50 per step. The probe cannot time
#   it itself: building an optimizer imports torch._dynamo (seconds).
ADAMW_OPS_PER_TENSOR = 8.0
ADAMW_FIXED_OPS = 40.0
# - the harness's per-step work besides the model (fetching and collating the batch with
#   DataLoader, DDP's forward hooks and bucket bookkeeping, GradScaler, zero_grad, the step
#   clock and record), in adds: 10-30-step dlaunch runs of tests/data/fp16_overflow.py took
#   1.0-2.3 ms median per step (data wait 0.2-0.5 ms of it) where the terms above give 0.8 ms
HARNESS_STEP_OPS = 100.0


def stream_s(nbytes: float, working_set: float, topology: Topology, *, ranks: int | None = None) -> float:
    """Seconds one rank takes to stream `nbytes` over `working_set` bytes while `ranks` ranks
    share the host (default: the topology's ranks per node; 1: a process alone, as the step
    probe ran). Each of the rank's threads streams its part of the working set at the probe's
    rate for that size (`CpuRates.stream_gb_s`): alone when it is the host's only streaming
    thread, the all-core rate when every core streams (in between, in proportion to the cores
    busy); ranks that time-share the cores take turns in one cache, so each sees all of theirs."""
    rates, share = rates_of(topology.accelerator, topology), core_share(topology, "stream")
    n = max(1, topology.devices_per_node if ranks is None else ranks)
    cores = max(1, topology.cpu_cores_per_node)
    running = min(n, cores)
    threads = topology.rank_threads if n <= cores else 1
    per_thread = working_set * (n / running) / threads
    alone = 1 / rates.stream_gb_s(per_thread)
    busy = min(1.0, (running * threads - 1) / max(1, cores - 1)) if cores > 1 else 0.0
    s_per_gb = alone + busy * (1 / rates.stream_gb_s(per_thread, all_cores=True) - alone)
    return nbytes * s_per_gb / share / 1e9


def _streams(profile: ModelProfile, precision: str, micro_batch: int,
             topology: Topology) -> tuple[tuple[float, float], ...]:
    """(bytes, working set) of one micro-batch's forward streams: ACTIVATION_PASSES over the
    saved activations at the compute dtype, and every weight once (the probe's GEMMs kept
    theirs in cache: what dominates a skinny MLP)."""
    prec = rates_of(topology.accelerator, topology).dtype(precision)
    act = profile.activation_bytes_per_sample * micro_batch * COMPUTE_DTYPE_BYTES[prec] / COMPUTE_DTYPE_BYTES["fp32"]
    weights = COMPUTE_DTYPE_BYTES[prec] * float(profile.num_params)
    return ((ACTIVATION_PASSES * act, act), (weights, weights))


@dataclass(frozen=True, kw_only=True)
class CpuForward:
    """Seconds of one micro-batch's forward and backward on one rank, by kind of work."""

    gemm_s: float
    attention_s: float
    conv_s: float
    memory_s: float
    cast_s: float  # the forward's casts
    grad_s: float  # the backward's gradient writes and casts
    attention_bwd: float = 3.0  # backward over forward of attention, of convolutions
    conv_bwd: float = 2.2

    @property
    def forward_s(self) -> float:
        """Matmuls, attention, convolutions, memory-bound work and casts."""
        return self.gemm_s + self.attention_s + self.conv_s + self.memory_s + self.cast_s

    @property
    def backward_s(self) -> float:
        """Twice the matmuls and memory traffic, attention and convolutions by their factors, and grad writes."""
        return (2 * (self.gemm_s + self.memory_s) + self.attention_bwd * self.attention_s
                + self.conv_bwd * self.conv_s + self.grad_s)


def cpu_forward(profile: ModelProfile, strategy: Strategy, micro_batch: int, topology: Topology) -> CpuForward:
    """One micro-batch on one CPU rank (see the module docstring)."""
    rates, share = rates_of(topology.accelerator, topology), core_share(topology, "gemm")
    prec = rates.dtype(strategy.precision)
    # attention written out ("eager") is matmuls and a softmax: priced as the matmuls and memory traffic they are
    attn_flops = 0.0 if profile.attention_kernel == "eager" else profile.attention_flops_fwd_per_sample * micro_batch
    conv_flops = profile.conv_flops_fwd_per_sample * micro_batch
    gemm_flops = max(0.0, profile.flops_fwd_per_sample * micro_batch - attn_flops - conv_flops)
    # one thread's GEMM FLOP/s at `rows` rows: the uses of each weight per micro-batch (FLOPs / 2 x params)
    rows = micro_batch * profile.flops_fwd_per_sample / (2 * max(1, profile.num_params))
    gemm_rate = rates.gemm_gflops[prec] * 1e9 * rows / (rows + rates.half_rows.get(prec, 0.0))
    attn_rate, attn_bwd = rates.attention(prec)
    conv_rate, conv_bwd = rates.conv(prec)
    p = float(profile.num_params)
    cast_fwd = cast_bwd = 0.0
    if prec != "fp32":
        if not strategy.shards_params:  # autocast: every weight down in forward, its gradient up
            cast_fwd = cast_bwd = CAST_BYTES_PER_PARAM * p
        else:  # FSDP: the local shard at each all-gather; the unsharded gradients up
            gathers = 1 if strategy.kind == "fsdp_grad_op" else 2
            cast_fwd = CAST_BYTES_PER_PARAM * p * gathers / max(1, topology.world_size)
            cast_bwd = CAST_BYTES_PER_PARAM * p
    cast_rate = rates.cast_gb_s * 1e9 * core_share(topology, "stream")
    grads = GRAD_TRAFFIC_BYTES * p
    memory = sum(stream_s(b, ws, topology) for b, ws in _streams(profile, prec, micro_batch, topology))
    return CpuForward(
        gemm_s=gemm_flops / (gemm_rate * share),
        attention_s=attn_flops / (attn_rate * share), conv_s=conv_flops / (conv_rate * share),
        memory_s=memory, cast_s=cast_fwd / cast_rate,
        grad_s=stream_s(grads, grads, topology) + cast_bwd / cast_rate,
        attention_bwd=attn_bwd, conv_bwd=conv_bwd)


def cpu_optimizer_s(profile: ModelProfile, group_size: int, topology: Topology, *, ranks: int | None = None) -> float:
    """The optimizer step over this rank's shard of the parameters (`ranks`: see stream_s)."""
    local = profile.num_params / max(1, group_size)
    # AdamW's passes scaled to the workload's optimizer; param, grad and its state (AdamW's two
    # moments: 16 B per parameter in all) stay in the working set
    working = GRAD_BYTES + MASTER_PARAM_BYTES + optimizer_state_bytes(profile, "adamw")[0]
    return stream_s(OPTIMIZER_BYTES_PER_PARAM * optimizer_step_share(profile) * local, working * local,
                    topology, ranks=ranks)


def shared_memory_s(profile: ModelProfile, precision: str, topology: Topology, micro_batch: int,
                    grad_accum: int, group_size: int, recompute: float) -> float:
    """Seconds a rank's step loses to the other ranks of its node over the same step of one
    process alone (what the step probe timed): its memory streams see its part of the
    last-level cache and of the memory bus instead of all of it."""
    if topology.devices_per_node <= 1:
        return 0.0
    grads = GRAD_TRAFFIC_BYTES * float(profile.num_params)

    def step(ranks: int | None) -> float:
        fwd = sum(stream_s(b, ws, topology, ranks=ranks)
                  for b, ws in _streams(profile, precision, micro_batch, topology))
        # backward streams the forward's traffic twice, and writes the gradients
        per_mb = fwd * (1 + recompute) + 2 * fwd + stream_s(grads, grads, topology, ranks=ranks)
        return grad_accum * per_mb + cpu_optimizer_s(profile, group_size, topology, ranks=ranks)

    return max(0.0, step(None) - step(1))


@dataclass(frozen=True, kw_only=True)
class CpuOverhead:
    """Seconds of per-op overhead in one optimizer step on one rank."""

    forward_s: float  # one micro-batch's forward
    backward_s: float  # its backward (engine start-up included)
    optimizer_s: float  # the optimizer step over every parameter tensor
    harness_s: float  # the training loop's own per-step work

    def step_s(self, grad_accum: int, recompute: float) -> float:
        """The step's total: `grad_accum` micro-batches, `recompute` of each forward again."""
        per_mb = self.forward_s * (1 + recompute) + self.backward_s
        return grad_accum * per_mb + self.optimizer_s + self.harness_s


def cpu_overhead(profile: ModelProfile, topology: Topology) -> CpuOverhead:
    """Per-op overhead of the profile's ops and parameter tensors (none for a profile without
    an op count), slowed as `cpu_rates.op_share` says (see the module docstring)."""
    if profile.forward_ops == 0:
        return CpuOverhead(forward_s=0.0, backward_s=0.0, optimizer_s=0.0, harness_s=0.0)
    rates = rates_of(topology.accelerator, topology)
    slow = 1 / op_share(topology)
    forward = OP_COST_SCALE * profile.forward_ops * rates.graph_op_s * slow
    # every rank steps every parameter tensor (FSDP's are shards of each)
    optimizer = (ADAMW_OPS_PER_TENSOR * profile.param_tensors + ADAMW_FIXED_OPS) * rates.op_s
    return CpuOverhead(forward_s=forward,
                       backward_s=rates.backward_call_s * slow + BACKWARD_OVERHEAD_FACTOR * forward,
                       optimizer_s=optimizer * slow, harness_s=HARNESS_STEP_OPS * rates.op_s * slow)


def _modelled(profile: ModelProfile, strategy: Strategy, topology: Topology, micro_batch: int,
              grad_accum: int, group_size: int, recompute: float) -> tuple[tuple[str, float], ...]:
    """The step's compute by kind of work, from the probe's rates (no measured step)."""
    fwd = cpu_forward(profile, strategy, micro_batch, topology)
    per_mb = fwd.forward_s * (1 + recompute) + fwd.backward_s
    opt = cpu_optimizer_s(profile, group_size, topology)
    overhead = cpu_overhead(profile, topology).step_s(grad_accum, recompute)
    scale = grad_accum * per_mb / fwd.forward_s if fwd.forward_s else 0.0
    # split by the forward's shares (the backward's gradient writes go with memory-bound work)
    return (("matmul", fwd.gemm_s * scale), ("attention", fwd.attention_s * scale),
            ("convolution", fwd.conv_s * scale), ("memory-bound", fwd.memory_s * scale),
            ("casts", fwd.cast_s * scale), ("optimizer", opt), ("op overhead", overhead))


def _measured(timing: StepTiming, profile: ModelProfile, topology: Topology, micro_batch: int,
              grad_accum: int, group_size: int, recompute: float) -> tuple[tuple[str, float], ...]:
    """The step's compute from the workload's own timed steps (`step_probe`, taken with this rank's
    thread count, alone on the host), slowed by time-sharing when ranks outnumber the cores and by
    the node's ranks streaming memory side by side (`shared_memory_s`); the optimizer's streaming
    share (the model's split) shrinks with FSDP's shard, its per-tensor work not."""
    slow = time_share(topology)
    p = timing.at(micro_batch)
    stream = cpu_optimizer_s(profile, 1, topology)
    overhead = cpu_overhead(profile, topology)
    per_tensor = overhead.optimizer_s
    local = stream / max(1, group_size) + per_tensor
    opt = timing.optimizer_s * (local / (stream + per_tensor) if stream + per_tensor > 0 else 1.0)
    shared = shared_memory_s(profile, timing.precision, topology, micro_batch, grad_accum, group_size, recompute)
    return (("data", grad_accum * p.data_s * slow),
            ("forward", grad_accum * p.forward_s * (1 + recompute) * slow),
            ("backward", grad_accum * p.backward_s * slow), ("optimizer", opt * slow),
            ("loop", overhead.harness_s), ("shared memory", shared))


def cpu_step_time(profile: ModelProfile, strategy: Strategy, topology: Topology, micro_batch: int, grad_accum: int, *,
                  group_size: int, recompute: float, timing: StepTiming | None = None) -> StepTimeEstimate:
    """Predicted time of one optimizer step on one CPU rank: `grad_accum` micro-batches (with
    `recompute` of the forward recomputed in backward), the optimizer over 1/`group_size` of
    the parameters, FSDP's own work, and the gloo collectives, none of them hidden. Compute is
    the workload's measured steps at `strategy.precision` when `timing` has them, else the
    probe's rates per kind of work."""
    if timing is not None:
        parts = _measured(timing, profile, topology, micro_batch, grad_accum, group_size, recompute)
    else:
        parts = _modelled(profile, strategy, topology, micro_batch, grad_accum, group_size, recompute)
    if strategy.shards_params:
        parts += (("FSDP work", grad_accum * fsdp_overhead_s(profile, strategy, topology)),)
    if topology.world_size <= 1 and not strategy.shards_params and gloo_of(topology) is not None:
        # DDP has no one-rank shortcut: every bucket still goes through gloo (a 1-rank all-reduce
        # on its worker thread): 0.55-0.75 ms per step of workloads/mlp.py's two buckets on a
        # 2-core VM, a fifth of its step, measured against the same loop unwrapped
        parts += (("DDP buckets", cpu_ddp_comm(profile, topology, strategy.reduce_bytes)),)
    comm = 0.0
    if topology.world_size > 1 and strategy.shards_params:
        comm = cpu_sharded_comm(profile, strategy, topology, grad_accum)
    elif topology.world_size > 1:
        comm = cpu_ddp_comm(profile, topology, strategy.reduce_bytes) + (
            cpu_zero1_sync(profile, topology) if strategy.kind == "zero1" else 0.0)
    return StepTimeEstimate(compute_s=sum(v for _, v in parts), comm_total_s=comm, comm_exposed_s=comm,
                            compute_parts=tuple((k, v) for k, v in parts if v > 0))


__all__ = ["CpuForward", "cpu_forward", "stream_s", "cpu_optimizer_s", "shared_memory_s", "cpu_step_time",
           "CpuOverhead", "cpu_overhead", "OP_COST_SCALE", "BACKWARD_OVERHEAD_FACTOR",
           "ADAMW_OPS_PER_TENSOR", "ADAMW_FIXED_OPS", "HARNESS_STEP_OPS", "ACTIVATION_PASSES",
           "GRAD_TRAFFIC_BYTES", "OPTIMIZER_BYTES_PER_PARAM", "CAST_BYTES_PER_PARAM"]

"""Step-time model of training on CPU processes (gloo), from what a matmul probe measured per core.

Pure arithmetic on the frozen specs: no torch, no I/O; never imports cli, backends, jobs,
runtime, results or report (`cpu_probe` measures the rates; this module only uses them).

Each rank runs max(1, cores // ranks) OpenMP threads (the launcher's OMP_NUM_THREADS); with more
ranks than cores the ranks time-share the cores, so a rank gets cores/ranks of one. Its rates
are the probe's single-thread rates times that share (a second thread adds PARALLEL_EFFICIENCY
of a core). One micro-batch's forward is the sum of:
- matmuls: FLOPs / (the dtype's large-GEMM rate x rows/(rows + half_rows)), where rows is how
  often each weight is reused per micro-batch, FLOPs / (2 x params): the micro-batch for an MLP,
  tokens for a transformer, output pixels for a convolution. half_rows is the row count at which
  the probe's GEMMs run at half their large-GEMM rate (fitted from its two shapes);
- memory-bound work (activations, norms, residuals, the loss): ACTIVATION_PASSES streams of the
  saved activations at the compute dtype, and one of the weights, through memory at the probe's
  bandwidth (its cache rate for the share of the working set that fits the rank's part of the
  last-level cache);
- bf16 autocast casts every weight to bf16 once per forward (autocast's cast cache lives for
  one forward) at the probe's cast rate: on a CPU without native bf16 the casts and the slow
  bf16 GEMMs make bf16 slower than fp32, which the probe shows and the planner then avoids.
Backward is twice the forward's matmuls and memory traffic, plus writing (or accumulating) the
fp32 gradient of every parameter; the optimizer streams OPTIMIZER_BYTES_PER_PARAM per local
parameter. Communication is the alpha-beta model of `collectives` over the topology's gloo
link, whose bandwidth shrinks with the ranks' share of a core (gloo copies and reduces on the
CPU); it overlaps with nothing (OVERLAP_EFFICIENCY: gloo's thread needs the cores compute uses).
On top comes the fixed cost of every operation (Python, the dispatcher, autograd), which
dominates a tiny model: the profile's forward ops at the probe's per-op cost, the backward as a
multiple of that, the AdamW step per parameter tensor and the harness's per-step work (see
`cpu_overhead`); one thread runs it, so only time-sharing a core slows it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass

from launcher.errors import PlanError
from launcher.hardware.types import DeviceSpec, Topology
from launcher.plan.collectives import ddp_comm, sharded_comm
from launcher.plan.memory import COMPUTE_DTYPE_BYTES, GRAD_BYTES
from launcher.plan.types import StepTimeEstimate
from launcher.specs import ModelProfile, Strategy, check

logger = logging.getLogger(__name__)

# Share of a core the second and later OpenMP threads of one rank add: small GEMMs and the
# single-threaded elementwise ops below torch's 32k-element grain do not split. Assumption
# (a 2-thread run cannot be timed on a loaded 2-core host), between MKL's near-linear scaling
# of large GEMMs and none for dispatch-bound ops.
PARALLEL_EFFICIENCY = 0.6
# Streams of the saved activations (compute dtype) through memory per forward: write the
# activation, read it for the next op, plus norms, GELU/ReLU, residual adds and the loss.
# Calibrated on single-thread timings (CPU time, best of 12, OMP_NUM_THREADS=1) of
# workloads/resnet.py (batch norm + ReLU heavy) and gpt.py tiny forwards at micro-batch 8
# against their matmul time from the probe.
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
# Bytes of one weight cast fp32 -> bf16 under autocast: read 4, write 2.
CAST_BYTES_PER_PARAM = 6
# A 1-element add without and with autograd graph building, and a backward() call through one,
# as the probe measured them on a 2-core 2.8 GHz Ice Lake VM with torch 2.13 (best of several,
# loaded host): used when no probe ran.
DEFAULT_OP_S = 3.9e-6
DEFAULT_GRAPH_OP_S = 4.6e-6
DEFAULT_BACKWARD_CALL_S = 30e-6
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
# Gloo communication cannot hide behind compute on CPU ranks: its threads copy and reduce on
# the cores the compute uses.
OVERLAP_EFFICIENCY = 0.0


@dataclass(frozen=True, kw_only=True)
class CpuRates:
    """What the probe measured on one core of this host (one thread)."""

    gemm_gflops: Mapping[str, float]  # large-GEMM rate by dtype (fp32, bf16)
    half_rows: Mapping[str, float]  # rows of a GEMM at which it runs at half that rate
    mem_gb_s: float  # streaming bandwidth (read + write) of one thread, beyond the caches
    cache_gb_s: float  # the same on a working set that fits the last-level cache
    cast_gb_s: float  # fp32 -> bf16 conversion bandwidth (bytes read + written)
    llc_bytes: float = 0.0  # the host's last-level cache (shared by all ranks); 0 = unknown
    # fixed seconds of one 1-element op without (op_s) and with (graph_op_s) autograd graph
    # building, and of one backward() call beyond its nodes
    op_s: float = DEFAULT_OP_S
    graph_op_s: float = DEFAULT_GRAPH_OP_S
    backward_call_s: float = DEFAULT_BACKWARD_CALL_S
    cpu_model: str = ""
    cores: int = 1
    measured_at: str = ""  # ISO time of the measurement
    source: str = ""

    def __post_init__(self) -> None:
        check("fp32" in self.gemm_gflops, PlanError, "CPU rates need an fp32 GEMM rate")
        for name, value in (*self.gemm_gflops.items(), ("mem_gb_s", self.mem_gb_s),
                            ("cache_gb_s", self.cache_gb_s), ("cast_gb_s", self.cast_gb_s)):
            check(value > 0, PlanError, f"CPU rate {name} must be > 0, got {value}")
        check(all(v >= 0 for v in self.half_rows.values()), PlanError,
              "CPU GEMM half_rows must be >= 0")
        check(min(self.op_s, self.graph_op_s, self.backward_call_s) >= 0, PlanError,
              "CPU op overheads must be >= 0")


@dataclass(frozen=True, kw_only=True)
class ProbedCpu(DeviceSpec):
    """One CPU process's share of a host (the DeviceSpec contract), with the probe's rates."""

    rates: CpuRates


# Used when no probe ran (a topology file planned on another machine, tests): GEMMs at the
# listed peak per core (the ISA peak of `hardware.detect.cpu_peak_tflops`, 32 FLOP/cycle, is what
# the probe reaches with one thread: 75-113 GFLOP/s against 90 on a 2.8 GHz Ice Lake), and the
# rest as the probe measured on that 2-core VM with torch 2.13 (best of several, loaded host):
# fp32 at 8 rows ~0.85 of its large-GEMM rate (half_rows 1.5), 64 MiB add 5-10 GB/s, fp32 -> bf16
# cast ~2 GB/s; 4 MiB add ~14 GB/s (the 0.92M-param MLP's AdamW step streams at that rate);
# its 48 MiB last-level cache.
DEFAULT_LLC_BYTES = 48 * 1024**2
DEFAULT_HALF_ROWS = 1.5
DEFAULT_MEM_GB_S = 8.0
DEFAULT_CACHE_GB_S = 14.0
DEFAULT_CAST_GB_S = 2.0


def rates_of(device: DeviceSpec, topology: Topology) -> CpuRates:
    """The probe's rates, or the device's listed peak per core with the default rest."""
    if isinstance(device, ProbedCpu):
        return device.rates
    per_core = topology.devices_per_node / max(1, topology.cpu_cores_per_node)
    return CpuRates(gemm_gflops={k: v * 1e3 * per_core for k, v in device.peak_tflops.items()},
                    half_rows={k: DEFAULT_HALF_ROWS for k in device.peak_tflops},
                    mem_gb_s=DEFAULT_MEM_GB_S, cache_gb_s=DEFAULT_CACHE_GB_S,
                    cast_gb_s=DEFAULT_CAST_GB_S, llc_bytes=DEFAULT_LLC_BYTES,
                    source=f"listed peak of {device.name} (no probe)")


def core_share(topology: Topology) -> float:
    """Cores' worth of compute one rank gets: its threads (cores // ranks, at least 1; the
    extra ones at PARALLEL_EFFICIENCY), or cores/ranks when ranks outnumber the cores."""
    cores, ranks = max(1, topology.cpu_cores_per_node), topology.devices_per_node
    threads = max(1, cores // ranks)
    if ranks > cores:
        return cores / ranks
    return 1 + (threads - 1) * PARALLEL_EFFICIENCY


def _rows(profile: ModelProfile, micro_batch: int) -> float:
    """How many times each weight is used per micro-batch: FLOPs / (2 x params)."""
    return micro_batch * profile.flops_fwd_per_sample / (2 * max(1, profile.num_params))


def gemm_rate(rates: CpuRates, precision: str, rows: float) -> float:
    """FLOP/s of one thread's GEMMs with `rows` rows at `precision`."""
    dtype = precision if precision in rates.gemm_gflops else "fp32"
    half = rates.half_rows.get(dtype, 0.0)
    return rates.gemm_gflops[dtype] * 1e9 * rows / (rows + half)


def stream_s(nbytes: float, working_set: float, topology: Topology) -> float:
    """Seconds one rank takes to stream `nbytes` over `working_set` bytes: the share of the
    working set that fits the rank's part of the last-level cache moves at the cache's rate,
    the rest at memory's."""
    rates, share = rates_of(topology.accelerator, topology), core_share(topology)
    llc = rates.llc_bytes / topology.devices_per_node
    cached = min(1.0, llc / working_set) if working_set > 0 else 1.0
    per_byte = cached / rates.cache_gb_s + (1 - cached) / rates.mem_gb_s
    return nbytes * per_byte / (1e9 * share)


@dataclass(frozen=True, kw_only=True)
class CpuForward:
    """Seconds of one micro-batch's forward and backward on one rank, by kind of work."""

    gemm_s: float
    memory_s: float
    cast_s: float
    grad_s: float

    @property
    def forward_s(self) -> float:
        """Matmuls, memory-bound work and autocast's weight casts."""
        return self.gemm_s + self.memory_s + self.cast_s

    @property
    def backward_s(self) -> float:
        """Twice the matmuls and memory traffic, plus the gradient writes."""
        return 2 * (self.gemm_s + self.memory_s) + self.grad_s


def cpu_forward(profile: ModelProfile, strategy: Strategy, micro_batch: int,
                topology: Topology) -> CpuForward:
    """One micro-batch on one CPU rank (see the module docstring)."""
    rates, share = rates_of(topology.accelerator, topology), core_share(topology)
    prec = strategy.precision if strategy.precision in rates.gemm_gflops else "fp32"
    flops = profile.flops_fwd_per_sample * micro_batch
    gemm = flops / (gemm_rate(rates, prec, _rows(profile, micro_batch)) * share)
    act = (profile.activation_bytes_per_sample * micro_batch
           * COMPUTE_DTYPE_BYTES[prec] / COMPUTE_DTYPE_BYTES["fp32"])
    # FSDP's MixedPrecisionPolicy gathers bf16 weights already cast (per shard, at unshard);
    # DDP's autocast casts every weight in each forward
    casts = CAST_BYTES_PER_PARAM * profile.num_params if prec != "fp32" else 0.0
    if strategy.kind != "ddp":
        casts /= max(1, topology.world_size)
    grads = GRAD_TRAFFIC_BYTES * profile.num_params
    # every weight streams in once per forward at the compute dtype (the probe's GEMMs kept
    # theirs in cache): what dominates a skinny MLP
    weights = COMPUTE_DTYPE_BYTES[prec] * profile.num_params
    memory = (stream_s(ACTIVATION_PASSES * act, act, topology)
              + stream_s(weights, weights, topology))
    return CpuForward(gemm_s=gemm, memory_s=memory,
                      cast_s=casts / (rates.cast_gb_s * 1e9 * share),
                      grad_s=stream_s(grads, grads, topology))


def cpu_optimizer_s(profile: ModelProfile, group_size: int, topology: Topology) -> float:
    """The optimizer step over this rank's shard of the parameters."""
    local = profile.num_params / max(1, group_size)
    # param, grad and two moments: 16 B per parameter stay in the working set
    return stream_s(OPTIMIZER_BYTES_PER_PARAM * local, 16 * local, topology)


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
    an op count). One thread runs it: more threads do not help, time-sharing a core slows it."""
    if profile.forward_ops == 0:
        return CpuOverhead(forward_s=0.0, backward_s=0.0, optimizer_s=0.0, harness_s=0.0)
    rates = rates_of(topology.accelerator, topology)
    slow = 1 / min(1.0, core_share(topology))
    forward = OP_COST_SCALE * profile.forward_ops * rates.graph_op_s * slow
    # every rank steps every parameter tensor (FSDP's are shards of each)
    optimizer = (ADAMW_OPS_PER_TENSOR * profile.param_tensors + ADAMW_FIXED_OPS) * rates.op_s
    return CpuOverhead(forward_s=forward,
                       backward_s=rates.backward_call_s * slow + BACKWARD_OVERHEAD_FACTOR * forward,
                       optimizer_s=optimizer * slow, harness_s=HARNESS_STEP_OPS * rates.op_s * slow)


def gloo_topology(topology: Topology) -> Topology:
    """The topology with its link slowed by the ranks' share of a core: gloo's copies and
    reductions run on the CPU, so ranks that time-share cores share that work too."""
    share = min(1.0, max(1, topology.cpu_cores_per_node) / topology.devices_per_node)
    if share >= 1.0:
        return topology
    intra = dataclasses.replace(topology.intra_node, bw_gb_s=topology.intra_node.bw_gb_s * share,
                                latency_us=topology.intra_node.latency_us / share)
    return dataclasses.replace(topology, intra_node=intra)


def cpu_step_time(profile: ModelProfile, strategy: Strategy, topology: Topology,
                  micro_batch: int, grad_accum: int, *, group_size: int,
                  recompute: float) -> StepTimeEstimate:
    """Predicted time of one optimizer step on one CPU rank: `grad_accum` micro-batches (with
    `recompute` of the forward recomputed in backward), the optimizer over 1/`group_size` of
    the parameters, and the gloo collectives, none of them hidden."""
    fwd = cpu_forward(profile, strategy, micro_batch, topology)
    per_mb = fwd.forward_s * (1 + recompute) + fwd.backward_s
    opt = cpu_optimizer_s(profile, group_size, topology)
    overhead = cpu_overhead(profile, topology).step_s(grad_accum, recompute)
    scale = grad_accum * per_mb / fwd.forward_s if fwd.forward_s else 0.0
    # split by the forward's shares (the backward's gradient writes go with memory-bound work)
    parts = (("matmul", fwd.gemm_s * scale), ("memory-bound", fwd.memory_s * scale),
             ("casts", fwd.cast_s * scale), ("optimizer", opt), ("op overhead", overhead))
    compute = grad_accum * per_mb + opt + overhead
    if topology.world_size <= 1:
        return StepTimeEstimate(compute_s=compute, comm_total_s=0.0, comm_exposed_s=0.0,
                                compute_parts=parts)
    gloo = gloo_topology(topology)
    bwd = fwd.backward_s + recompute * fwd.forward_s
    if strategy.kind == "ddp":
        total, exposed = ddp_comm(profile, gloo, bwd * OVERLAP_EFFICIENCY)
    else:
        total, exposed = sharded_comm(profile, strategy, gloo, fwd.forward_s * OVERLAP_EFFICIENCY,
                                      bwd * OVERLAP_EFFICIENCY, grad_accum)
    return StepTimeEstimate(compute_s=compute, comm_total_s=total, comm_exposed_s=exposed,
                            compute_parts=parts)


__all__ = ["CpuRates", "ProbedCpu", "DEFAULT_HALF_ROWS", "DEFAULT_MEM_GB_S", "DEFAULT_CAST_GB_S",
           "DEFAULT_CACHE_GB_S", "DEFAULT_LLC_BYTES", "CpuForward", "cpu_forward", "stream_s",
           "cpu_optimizer_s", "cpu_step_time", "core_share", "gemm_rate", "gloo_topology",
           "rates_of", "CpuOverhead", "cpu_overhead", "OP_COST_SCALE", "BACKWARD_OVERHEAD_FACTOR",
           "ADAMW_OPS_PER_TENSOR", "ADAMW_FIXED_OPS", "HARNESS_STEP_OPS", "DEFAULT_OP_S",
           "DEFAULT_GRAPH_OP_S", "DEFAULT_BACKWARD_CALL_S", "PARALLEL_EFFICIENCY", "ACTIVATION_PASSES",
           "GRAD_TRAFFIC_BYTES",
           "OPTIMIZER_BYTES_PER_PARAM", "CAST_BYTES_PER_PARAM", "OVERLAP_EFFICIENCY"]

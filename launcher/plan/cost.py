"""Step-time model: compute by kind of work, communication from the alpha-beta model.

Pure arithmetic on the frozen specs: no torch, no I/O; never imports cli, backends or runtime.

One micro-batch's forward on a GPU is the sum of three kinds of work, each at its own rate:
- matmuls (the profile's FLOPs minus attention) at the dtype's peak x a matmul efficiency that
  rises with the GEMM's size: the architecture's best large-GEMM fraction (MAMF), times
  w/(w + GEMM_HALF_WIDTH) for model width w and t/(t + GEMM_HALF_TOKENS) for t tokens per
  micro-batch: narrow models and short micro-batches run far below peak;
- attention (flash attention, causal: half the profiled 4 s^2 d FLOPs per block) at the
  architecture's flash-attention fraction x s/(s + ATTENTION_HALF_SEQ);
- memory-bound work (norms, activations, residual adds, casts, rotary, loss) proportional to the
  activation bytes the forward saves, over the HBM bandwidth (MEMORY_PASSES HBM round trips per
  saved byte, fewer with torch.compile, which fuses the elementwise chains).
Backward is twice the forward (flash attention's 2.5x); checkpointing recomputes
`recompute_fraction` of the forward inside backward (1 = every block, 4/3 the compute; 0.5 =
every other block, or per-op selective checkpointing that saves every other matmul). The
optimizer step streams fp32 params, grads and AdamW state through HBM once.

Communication (collectives.py) hides behind compute but is not free: NCCL's kernels take SMs and
HBM bandwidth from the matmuls they overlap, so every hidden second costs CONTENTION seconds of
compute; what compute cannot hide (the first all-gather of a forward, the last reduce-scatter of
a backward, traffic beyond the phase) is exposed. Every collective synchronises the ranks, so the
step waits for the slowest: with per-step jitter of coefficient of variation STEP_JITTER the
expected maximum over N ranks is sqrt(2 ln N) standard deviations above the mean.

CPU ranks have their own model (`cpu_cost`: the probe's per-core rates shared among the ranks
and threads, gloo communication that overlaps nothing); `step_time`, `compute_s` and
`optimizer_s` hand CPU devices (no compute capability) to it.

Pure: never imports torch, does no I/O, and never imports cli, backends, jobs, runtime, results
or report.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass

from launcher.hardware.types import DeviceSpec, Topology
from launcher.plan.collectives import ddp_comm, dp_topology, sharded_comm, tp_comm_s
from launcher.plan.cpu_cost import cpu_step_time
from launcher.plan.memory import COMPUTE_DTYPE_BYTES
from launcher.plan.step_probe import WorkloadTiming, timing_key
from launcher.plan.types import StepTimeEstimate
from launcher.specs import ModelProfile, Strategy

logger = logging.getLogger(__name__)

# --- GPU compute -----------------------------------------------------------------------------
# Best bf16 GEMM a GPU sustains, as a fraction of its dense peak, by compute capability: the
# "maximum achievable matmul FLOPS" (MAMF) of stas00/ml-engineering, compute/accelerator/README.md:
# A100 SXM 267.9 of 312 TFLOP/s, H100 SXM 792.1 of 989 (CUDA 12.1). Other GPUs: the H100 figure.
GEMM_PEAK_FRACTION = {(8, 0): 0.859, (9, 0): 0.801}
GEMM_PEAK_FRACTION_DEFAULT = 0.80
# Small GEMMs run below MAMF (tile and wave quantization, NVIDIA's "Matrix Multiplication
# Background" guide): efficiency x w/(w + W) x t/(t + T) for width w and t tokens per micro-
# batch: 768 wide keeps 71% of MAMF, 8192 wide 96%; 2048 tokens 80%, 16k 97%. FIT: W and T,
# with MEMORY_PASSES, COMPILE_MEMORY_FACTOR, CONTENTION and STEP_JITTER, jointly over the 61
# rows of benchmarks/published (grid search, least mean |log(predicted/published)|; holding out
# each source in turn and fitting on the rest predicts it within a median 3-8%).
GEMM_HALF_WIDTH = 320
GEMM_HALF_TOKENS = 512
# Flash attention forward+backward, causal, head dim 128, as a fraction of the dense peak at long
# sequences: FlashAttention-2 (Dao 2023, arXiv 2307.08691, Fig. 4-6) ~200 of 312 TFLOP/s on
# A100, ~335 of 989 on H100 (FA2 uses no Hopper-specific instructions). Throughput halves around
# 512 tokens and saturates by 8k in the same figures.
ATTENTION_PEAK_FRACTION = {(8, 0): 0.64, (9, 0): 0.35}
ATTENTION_PEAK_FRACTION_DEFAULT = 0.35
ATTENTION_HALF_SEQ = 512
# Backward of flash attention: 5 matmuls against the forward's 2 (FA2 paper, section 3).
ATTENTION_BWD_FACTOR = 2.5
# HBM bandwidth, datasheets: by product name where one architecture ships with different memory
# (A100 40GB HBM2 1555 GB/s vs 80GB HBM2e 2039; H100 PCIe 2000, NVL 3900, the 94/96 GB HBM2e
# H100 2410 (measured 2.41 TB/s, arXiv 2604.11391) vs SXM5 80GB HBM3 3350; H200 and H200 NVL
# 141 GB HBM3e 4800 (H200 datasheet); GH200 96 GB HBM3 4000, 144 GB HBM3e 4900 (GH200
# datasheet); GB200 186 GB HBM3e 8000 (GB200 NVL72 spec table), HGX B200 180 GB HBM3e 7700
# (HGX spec table: 62 TB/s per 8 GPUs; 8 TB/s in the first datasheet)), else by compute
# capability: V100 900, T4 320, A100 2039, A10/RTX 3090-class 936, L40S 864, H100 SXM5 3350,
# B200 7700, RTX 5090 / RTX PRO 6000 Blackwell 32 GB GDDR7 1792 (RTX Blackwell whitepaper).
HBM_GB_S_BY_NAME = (("a100-sxm4-40gb", 1555), ("a100-pcie-40gb", 1555), ("h100 pcie", 2000),
                    ("h100 nvl", 3900), ("hbm2e", 2410), ("gh200 144g", 4900), ("gh200", 4000),
                    ("h200", 4800), ("gb200", 8000), ("b200", 7700))
HBM_GB_S = {(7, 0): 900, (7, 5): 320, (8, 0): 2039, (8, 6): 936, (8, 9): 864, (9, 0): 3350,
            (10, 0): 7700, (12, 0): 1792}
HBM_GB_S_DEFAULT = 2000
_MIG_INSTANCE = re.compile(r"\bmig (?:\d+c\.)?(\d+)g\b")  # lower-cased names
# HBM round trips per byte of saved activations for the memory-bound work of one forward (eager
# PyTorch runs each norm, activation, residual add, cast and rotary as separate kernels that read
# and write whole activations). FIT (see GEMM_HALF_WIDTH): 61 rows.
MEMORY_PASSES = 5.0
# torch.compile fuses those elementwise chains into fewer kernels: the share of the eager traffic
# that remains. FIT (see GEMM_HALF_WIDTH), resting on the 10 rows with compile (torchtitan 8B
# on 8/128 H100 eager vs compile: +16%; IBM Llama 2 7B-70B).
COMPILE_MEMORY_FACTOR = 0.6
# AdamW step per parameter of the local shard: read fp32 param, grad, m, v (16 B), write param,
# m, v (12 B); a memory-bound kernel (fused or foreach).
OPTIMIZER_BYTES_PER_PARAM = 28

# --- overlap -----------------------------------------------------------------------------------
# Share of a compute phase communication can hide behind. CUDA: NCCL runs on its own stream
# for the whole phase; its cost is in CONTENTION instead (CPU ranks hide nothing: `cpu_comm`).
OVERLAP_EFFICIENCY = {"cuda": 1.0}
# Compute seconds lost per second of communication hidden behind it: NCCL's ring kernels occupy
# up to 16-32 of the GPU's SMs and stream every byte through HBM (nccl-tests #212). FIT (see
# GEMM_HALF_WIDTH), resting mostly on the MPT rows whose accumulation re-gathers all weights
# per micro-batch and on IBM's 400 Gb/s cluster.
CONTENTION = {"cuda": 0.15}
# Coefficient of variation of one rank's step time (clock and power throttling, the host,
# network jitter). FIT (see GEMM_HALF_WIDTH), resting on the 4 published scaling series
# (8 -> 64/128 GPUs).
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
# Checkpointing every block recomputes the whole forward: 4/3 of the compute.
FULL_RECOMPUTE = 1.0


@dataclass(frozen=True, kw_only=True)
class ForwardPass:
    """Seconds of one micro-batch's forward on one device, by kind of work."""

    gemm_s: float
    attention_s: float
    memory_s: float

    @property
    def total_s(self) -> float:
        """All three."""
        return self.gemm_s + self.attention_s + self.memory_s

    @property
    def backward_s(self) -> float:
        """Backward: twice the matmuls and memory traffic, flash attention's 2.5x."""
        return 2 * (self.gemm_s + self.memory_s) + ATTENTION_BWD_FACTOR * self.attention_s


def peak_flops(device: DeviceSpec, precision: str) -> float:
    """Dense peak FLOP/s for the precision's matmuls; fp32 stays fp32 (PyTorch leaves TF32 off
    for matmuls by default). A dtype the device does not list falls back to its fp32 peak."""
    tflops = device.peak_tflops.get(precision) or device.peak_tflops["fp32"]
    return tflops * 1e12


def model_width(profile: ModelProfile) -> float | None:
    """The residual width of a sequence model: its first block's input (profiled in fp32) per
    token / 4 bytes; None for other models."""
    if profile.sample_units != "tokens" or profile.block_input_bytes_per_sample <= 0:
        return None
    return profile.block_input_bytes_per_sample / (4 * profile.units_per_sample)


def attention_flops_fwd(profile: ModelProfile) -> float:
    """Attention FLOPs per sample as the profile counts them (SDPA: 4 s^2 d per block, the
    causal mask ignored): measured where SDPA was called, else (a profile from before that was
    counted) one self-attention of the residual width per block."""
    if profile.attention_flops_fwd_per_sample > 0:
        return profile.attention_flops_fwd_per_sample
    width = model_width(profile)
    if width is None:
        return 0.0
    s = profile.units_per_sample
    return min(4.0 * s * s * width * profile.num_blocks, 0.9 * profile.flops_fwd_per_sample)


def gemm_efficiency(device: DeviceSpec, width: float | None, tokens: float,
                    precision: str = "bf16") -> float:
    """Fraction of the dense peak the matmuls of a micro-batch of `tokens` tokens run at.

    What a small GEMM loses (loading operand tiles, the epilogue, partial waves) costs in
    proportion to how fast its arithmetic is, so the half-saturation width and tokens scale with
    the precision's peak over the tensor cores' bf16 peak: fp32 matmuls on CUDA cores (67 of 989
    TFLOP/s on an H100) saturate at 1/15 the size. Measured on one H100 (docs/benchmarks.md, GPU
    acceptance run 3): GPT-2 small (768 wide) in fp32 stepped in 0.631 s against 0.94 s
    predicted with bf16's half-widths; the fp32 MAMF fraction is bf16's (an assumption)."""
    eff = GEMM_PEAK_FRACTION.get(device.compute_capability or (0, 0), GEMM_PEAK_FRACTION_DEFAULT)
    if width is not None:
        bf16 = device.peak_tflops.get("bf16") or device.peak_tflops["fp32"]
        scale = min(1.0, (device.peak_tflops.get(precision) or device.peak_tflops["fp32"]) / bf16)
        eff *= (width / (width + GEMM_HALF_WIDTH * scale)
                * tokens / (tokens + GEMM_HALF_TOKENS * scale))
    return eff


def attention_efficiency(device: DeviceSpec, seq_len: int) -> float:
    """Fraction of the dense peak causal flash attention runs at for sequences of `seq_len`."""
    top = ATTENTION_PEAK_FRACTION.get(device.compute_capability or (0, 0),
                                      ATTENTION_PEAK_FRACTION_DEFAULT)
    return top * seq_len / (seq_len + ATTENTION_HALF_SEQ)


def hbm_bytes_per_s(device: DeviceSpec) -> float:
    """The device's memory bandwidth (datasheets: see HBM_GB_S_BY_NAME and HBM_GB_S)."""
    name = device.name.lower()
    # a MIG slice ("... MIG 1g.10gb", "... MIG 2g slice") has its GPU instance's share of the
    # memory controllers: about its compute slices over the 7 a GPU has (1g: 1 of 8 memory
    # slices, 3g and 4g: 4 of 8; MIG user guide)
    mig = _MIG_INSTANCE.search(name)
    share = min(1.0, int(mig.group(1)) / 7) if mig else 1.0
    for needle, gb_s in HBM_GB_S_BY_NAME:
        if needle in name:
            return gb_s * 1e9 * share
    return HBM_GB_S.get(device.compute_capability or (0, 0), HBM_GB_S_DEFAULT) * 1e9 * share


def forward_pass(profile: ModelProfile, strategy: Strategy, micro_batch: int,
                 device: DeviceSpec) -> ForwardPass:
    """One micro-batch's forward on GPU `device`, by kind of work (see the module docstring).

    Tensor parallelism of degree t = `strategy.tp` (with sequence parallelism) narrows each
    rank's matmuls to width / t (priced by `gemm_efficiency` at that width) and gives it 1/t of
    the matmul FLOPs, 1/t of the attention heads and 1/t of the memory-bound work (the norms,
    residuals and activations run on 1/t of the sequence). x / 1 is exact: tp = 1 is unchanged."""
    tp = strategy.tp
    peak = peak_flops(device, strategy.precision)
    attn = attention_flops_fwd(profile)
    tokens = micro_batch * profile.units_per_sample
    width = model_width(profile)
    if width is not None:
        width = width / tp
    gemm = (profile.flops_fwd_per_sample - attn) / tp * micro_batch / (
        peak * gemm_efficiency(device, width, tokens, strategy.precision))
    # causal flash attention skips the upper triangle: half the profiled FLOPs
    attention = 0.5 * attn / tp * micro_batch / (
        peak * attention_efficiency(device, profile.units_per_sample))
    passes = MEMORY_PASSES * (COMPILE_MEMORY_FACTOR if strategy.compile else 1.0)
    # the profile measured fp32 tensors; the traffic moves at the compute dtype (whatever
    # autocast keeps in fp32 is small next to the matmul inputs and outputs)
    saved = (profile.activation_bytes_per_sample / tp * micro_batch
             * COMPUTE_DTYPE_BYTES[strategy.precision] / COMPUTE_DTYPE_BYTES["fp32"])
    return ForwardPass(gemm_s=gemm, attention_s=attention,
                       memory_s=passes * saved / hbm_bytes_per_s(device))


def _recompute(strategy: Strategy, recompute_fraction: float) -> float:
    return recompute_fraction if strategy.activation_checkpointing else 0.0


def compute_s(profile: ModelProfile, strategy: Strategy, micro_batch: int, grad_accum: int,
              device: DeviceSpec, *, recompute_fraction: float = FULL_RECOMPUTE) -> float:
    """Compute time of `grad_accum` micro-batches on one GPU (no optimizer step): forward,
    backward, and the recomputed share of the forward with checkpointing. CPU ranks depend on
    how many share the host: `cpu_cost.cpu_forward`."""
    fwd = forward_pass(profile, strategy, micro_batch, device)
    per_mb = fwd.total_s * (1 + _recompute(strategy, recompute_fraction)) + fwd.backward_s
    return per_mb * grad_accum


def optimizer_s(profile: ModelProfile, group_size: int, device: DeviceSpec) -> float:
    """The AdamW step over this rank's shard of the parameters on a GPU (CPU:
    `cpu_cost.cpu_optimizer_s`)."""
    local = profile.num_params / max(1, group_size)
    return OPTIMIZER_BYTES_PER_PARAM * local / hbm_bytes_per_s(device)


def shard_group_size(kind: str, topology: Topology, tp: int = 1) -> int:
    """Ranks that share one copy of the model state (of one TP slice, with tensor parallelism
    of degree `tp`): 1 (DDP), a node's ranks / tp (hybrid), all ranks / tp (FSDP)."""
    return {"ddp": 1, "hybrid": topology.devices_per_node // tp}.get(
        kind, topology.world_size // tp)


def step_time(profile: ModelProfile, strategy: Strategy, topology: Topology, micro_batch: int,
              grad_accum: int, *, recompute_fraction: float = FULL_RECOMPUTE,
              timing: WorkloadTiming | None = None) -> StepTimeEstimate:
    """Predicted time of one optimizer step (grad_accum micro-batches) on one rank.

    - ddp: one all-reduce of the fp32 grads per step in 25 MiB buckets (no_sync during
      accumulation), hidden behind the last micro-batch's backward except the final bucket.
    - fsdp_full: per micro-batch all-gather (compute dtype) in forward and again in backward
      (the root unit stays gathered), reduce-scatter of fp32 grads in backward. The first
      gather of a forward and the last reduce-scatter of a backward have nothing to hide behind.
    - fsdp_grad_op: per micro-batch one all-gather in forward (kept for backward) plus the
      reduce-scatter in backward.
    - hybrid: fsdp_full's traffic inside a node, plus one all-reduce of each rank's 1/G grad
      shard across nodes per step (the runtime disables it on all but the last micro-batch).
    - tensor parallelism (`strategy.tp` = t > 1, FSDP kinds only): compute per rank as
      `forward_pass` narrows it; FSDP's traffic is that of the data-parallel group
      (`dp_topology`: world / t ranks, each moving its 1/t slice of the parameters); and each
      micro-batch adds TP + SP's activation all-gathers and reduce-scatters over NVLink
      (`collectives.tp_comm_s`), all exposed: without async TP each one sits between the
      matmuls that produce and consume it. The optimizer steps params / (t x shard group).
    Hidden communication costs CONTENTION of its time in compute; the whole step is stretched by
    the expected wait for the slowest of the ranks (STEP_JITTER), and beyond LEAF_NODES nodes
    by SCALE_TAX per doubling of nodes (the fabric's spine).
    CPU ranks: `cpu_cost.cpu_step_time`, with the workload's own timed steps (`timing`) when
    the planning host measured them.
    """
    device, kind, n = topology.accelerator, topology.device, topology.world_size
    if device.compute_capability is None:
        key = timing_key(strategy.precision, strategy.kind, profile.batch_norms)
        measured = None if timing is None else (timing.precisions.get(key)
                                                or timing.precisions.get(strategy.precision))
        return cpu_step_time(profile, strategy, topology, micro_batch, grad_accum,
                             group_size=shard_group_size(strategy.kind, topology, strategy.tp),
                             recompute=_recompute(strategy, recompute_fraction), timing=measured)
    fwd = forward_pass(profile, strategy, micro_batch, device)
    fwd_s = fwd.total_s
    bwd_s = fwd.backward_s + _recompute(strategy, recompute_fraction) * fwd_s
    # the optimizer steps this rank's shard of its TP slice: params / (tp x shard group)
    opt = optimizer_s(profile, strategy.tp * shard_group_size(strategy.kind, topology,
                                                              strategy.tp), device)
    compute = grad_accum * (fwd_s + bwd_s) + opt
    scale = grad_accum * (fwd_s + bwd_s) / fwd_s if fwd_s else 0.0
    parts = (("matmul", fwd.gemm_s * scale), ("attention", fwd.attention_s * scale),
             ("memory-bound", fwd.memory_s * scale), ("optimizer", opt))
    if n <= 1:
        return StepTimeEstimate(compute_s=compute, comm_total_s=0.0, comm_exposed_s=0.0,
                                compute_parts=parts)
    ovl = OVERLAP_EFFICIENCY[kind]
    if strategy.kind == "ddp":
        total, exposed = ddp_comm(profile, topology, bwd_s * ovl)
    else:
        total, exposed = sharded_comm(profile, strategy, dp_topology(topology, strategy.tp),
                                       fwd_s * ovl, bwd_s * ovl, grad_accum)
    if strategy.tp > 1:
        # TP's activation collectives wait on the matmuls they feed: exposed (no async TP)
        tp_s = grad_accum * tp_comm_s(profile, strategy, topology, micro_batch,
                                      recompute=_recompute(strategy, recompute_fraction))
        total, exposed = total + tp_s, exposed + tp_s
    hidden = max(0.0, total - exposed)
    contention = CONTENTION[kind] * hidden
    busy = compute + exposed + contention
    sync = (STEP_JITTER[kind] * math.sqrt(2 * math.log(n))
            + SCALE_TAX[kind] * max(0.0, math.log2(topology.num_nodes / LEAF_NODES))) * busy
    return StepTimeEstimate(compute_s=compute, comm_total_s=total, comm_exposed_s=exposed,
                            contention_s=contention, sync_wait_s=sync, compute_parts=parts)


__all__ = ["step_time", "compute_s", "forward_pass", "optimizer_s", "peak_flops",
           "gemm_efficiency", "attention_efficiency", "hbm_bytes_per_s", "model_width",
           "attention_flops_fwd", "shard_group_size", "ForwardPass", "GEMM_PEAK_FRACTION",
           "GEMM_HALF_WIDTH", "GEMM_HALF_TOKENS", "ATTENTION_PEAK_FRACTION",
           "ATTENTION_HALF_SEQ", "LEAF_NODES", "SCALE_TAX", "HBM_GB_S", "HBM_GB_S_BY_NAME",
           "MEMORY_PASSES", "COMPILE_MEMORY_FACTOR",
           "OPTIMIZER_BYTES_PER_PARAM", "OVERLAP_EFFICIENCY",
           "CONTENTION", "STEP_JITTER",
           "FULL_RECOMPUTE", "dp_topology"]

"""Step-time model: compute from FLOPs, communication from the alpha-beta model.

Pure arithmetic on the frozen specs: no torch, no I/O.

Collectives (nccl-tests' conventions, PERFORMANCE.md): over n ranks, S bytes,
bandwidth B = `link.bw_gb_s * 1e9` (the achievable bus bandwidth per device of the slowest link
the ring crosses) and alpha = `link.latency_us * 1e-6` per ring step:

    all-reduce      2(n-1)/n * S/B + 2(n-1) * alpha
    all-gather      (n-1)/n * S/B + (n-1) * alpha      (S = the gathered, full size)
    reduce-scatter  (n-1)/n * S/B + (n-1) * alpha      (S = the full input size)

Across nodes (the convention of topologies/*.yaml): `inter_node.bw_gb_s` is the bus bandwidth a
ring spanning the nodes sees per rank when all G ranks of a node take part, i.e. the node's
aggregate network bandwidth (NCCL spreads its channels over the rails). G collectives that run at
once with one rank per node each (hybrid replicas, the inter-node phase of a hierarchical
all-reduce) share it: each gets bw / G.
- all-gather / reduce-scatter across nodes: NCCL only has ring algorithms for them with several
  ranks per node, so a flat ring over all N ranks at the slowest link's bandwidth, with the
  slowest link's latency per step (ring steps advance in lockstep).
- all-reduce across nodes: NCCL's tuner picks ring or tree per message size; we take the fastest
  of the flat ring and the two-level (hierarchical) all-reduce: intra-node reduce-scatter,
  inter-node all-reduce of 1/G of the data (G of them at once on the shared network; a ring, or
  a tree with 2 log2(M) latencies as NCCL's double binary tree has), intra-node all-gather. The
  hierarchical form crosses the network with 2(M-1)/M x S per node instead of the flat ring's
  2(N-1)/N x S. Its phases are summed, not pipelined, which errs slightly on the slow side.

Overlap: communication issued during a compute phase hides behind `OVERLAP_EFFICIENCY` of that
phase (NCCL kernels take SMs and memory bandwidth from compute, so not all of it); what is left,
and the collectives that have nothing to overlap with (the first all-gather of a forward, the
last bucket/unit of a backward), are exposed.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable

from launcher.plan.memory import COMPUTE_DTYPE_BYTES, DDP_BUCKET_CAP_BYTES, GRAD_BYTES, unsharded_root_params
from launcher.plan.types import StepTimeEstimate
from launcher.specs import DeviceSpec, Link, ModelProfile, Strategy, Topology

logger = logging.getLogger(__name__)

# Fraction of the dtype's dense peak a training step sustains (model FLOPs utilisation).
# CUDA: Megatron-LM sustains 44-52% of A100 peak on large GPTs (Narayanan et al. 2021); a bare
# bf16 8192^3 matmul reaches 80% on H100 (790 of 989, design.md) and a step adds attention,
# norms, the optimizer and launch gaps. 0.40 is a conservative middle for PyTorch eager/FSDP.
ACHIEVABLE_FRACTION_CUDA = 0.40
# CPU: measured on this repo's 2-core AMD EPYC (Zen 4, 2.6 GHz, 32 fp32 FLOP/cycle/core -> 166
# GFLOP/s fp32, 333 bf16 via avx512_bf16), workloads/gpt.py `tiny`, batch 8, AdamW, torch 2.13:
# fp32 107 GFLOP/s (0.64 of peak), bf16 autocast 136-153 GFLOP/s (0.41-0.46).
ACHIEVABLE_FRACTION_CPU = {"fp32": 0.6, "bf16": 0.45, "fp16": 0.45}
# Forward + backward = 3 forward passes; per-block checkpointing recomputes the forward: 4 / 3.
FWD_BWD_FACTOR = 3.0
CHECKPOINT_RECOMPUTE_FACTOR = 4.0 / 3.0
# Share of a compute phase that communication can hide behind (an assumption, not a measurement).
# CUDA: NCCL runs on its own stream but its kernels take SMs and HBM bandwidth from compute.
# CPU/gloo: the collective thread competes with compute for the same few cores.
OVERLAP_EFFICIENCY = {"cuda": 0.8, "cpu": 0.5}
# Fixed cost of each FSDP collective on the critical path, beyond its alpha-beta time: FSDP2's
# pre-forward/post-backward hooks, the copy-in (chunk_cat) and copy-out (split_with_sizes_copy)
# kernels on the compute stream and the cross-stream waits. CUDA: the hooks cost 0.1-1 ms of CPU
# per unit (pytorch#173680) but mostly run ahead of the GPU; copy-out of a 0.15 GB gather takes
# ~0.2-0.3 ms (pytorch#115515) -> 50 us per collective. CPU/gloo: calibrated on design.md's 3.7M
# GPT, 2 ranks: FSDP2 0.43 s/step vs DDP 0.34 s/step, ~85 ms beyond the byte difference over
# 14 collectives -> ~5 ms each. DDP's reducer is C++ and its buckets are views: no such term.
FSDP_COLLECTIVE_OVERHEAD_S = {"cuda": 50e-6, "cpu": 5e-3}
# FSDP reduces gradients in fp32 (MixedPrecisionPolicy(reduce_dtype=float32)); DDP all-reduces
# the fp32 .grad buckets.
REDUCE_DTYPE_BYTES = 4


def _alpha(link: Link) -> float:
    return link.latency_us * 1e-6


def _beta(link: Link) -> float:
    return link.bw_gb_s * 1e9


def ring_allreduce_s(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce of `nbytes` over `n` ranks: 2(n-1)/n * S/B + 2(n-1) * alpha."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) / n * nbytes / _beta(link) + 2 * (n - 1) * _alpha(link)


def allgather_s(nbytes: float, n: int, link: Link) -> float:
    """Ring all-gather whose gathered output is `nbytes`: (n-1)/n * S/B + (n-1) * alpha."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) / n * nbytes / _beta(link) + (n - 1) * _alpha(link)


def reduce_scatter_s(nbytes: float, n: int, link: Link) -> float:
    """Ring reduce-scatter of an `nbytes` input: (n-1)/n * S/B + (n-1) * alpha."""
    return allgather_s(nbytes, n, link)


def tree_allreduce_s(nbytes: float, n: int, link: Link) -> float:
    """NCCL's double binary tree all-reduce: the ring's bandwidth term ("full bandwidth", NCCL
    2.4 release notes) with 2 * ceil(log2 n) latencies instead of 2(n-1)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) / n * nbytes / _beta(link) + 2 * math.ceil(math.log2(n)) * _alpha(link)


def shared_link(link: Link, groups: int) -> Link:
    """`link` as seen by each of `groups` collectives that run at once and share it."""
    return dataclasses.replace(link, bw_gb_s=link.bw_gb_s / max(1, groups))


def slowest_link(intra: Link, inter: Link | None) -> Link:
    """The link that bounds a flat ring crossing both: lowest bandwidth, highest latency."""
    if inter is None:
        return intra
    return dataclasses.replace(inter, bw_gb_s=min(intra.bw_gb_s, inter.bw_gb_s),
                               latency_us=max(intra.latency_us, inter.latency_us))


def hierarchical_allreduce_s(nbytes: float, devices_per_node: int, num_nodes: int,
                             intra: Link, inter: Link | None, *, tree: bool = False) -> float:
    """Two-level all-reduce: intra-node reduce-scatter, inter-node all-reduce of 1/G of the data
    (the G local ranks' all-reduces run at once and share `inter`; a ring, or NCCL's tree with
    `tree=True`), intra-node all-gather."""
    g, m = devices_per_node, num_nodes
    if m <= 1 or inter is None:
        return ring_allreduce_s(nbytes, g, intra)
    across = tree_allreduce_s if tree else ring_allreduce_s
    return (reduce_scatter_s(nbytes, g, intra) + across(nbytes / g, m, shared_link(inter, g))
            + allgather_s(nbytes, g, intra))


Collective = Callable[[float], float]


def _group(topology: Topology, *, within_node: bool = False) -> dict[str, Collective]:
    """The three collectives over all ranks (or over one node's ranks) of `topology`."""
    g = topology.devices_per_node
    if within_node or topology.num_nodes <= 1 or topology.inter_node is None:
        intra = topology.intra_node
        return {"ag": lambda s: allgather_s(s, g, intra),
                "rs": lambda s: reduce_scatter_s(s, g, intra),
                "ar": lambda s: ring_allreduce_s(s, g, intra)}
    n, m = topology.world_size, topology.num_nodes
    intra, inter = topology.intra_node, topology.inter_node
    flat = slowest_link(intra, inter)
    return {"ag": lambda s: allgather_s(s, n, flat),
            "rs": lambda s: reduce_scatter_s(s, n, flat),
            "ar": lambda s: min(ring_allreduce_s(s, n, flat),
                                hierarchical_allreduce_s(s, g, m, intra, inter),
                                hierarchical_allreduce_s(s, g, m, intra, inter, tree=True))}


def _split(op: Collective, total: float, count: int) -> float:
    """`count` equal collectives moving `total` bytes together (latency paid `count` times)."""
    count = max(1, count)
    return count * op(total / count)


def peak_flops(device: DeviceSpec, precision: str) -> float:
    """Dense peak FLOP/s for the precision's matmuls; fp32 stays fp32 (PyTorch leaves TF32 off
    for matmuls by default). A dtype the device does not list falls back to its fp32 peak."""
    tflops = device.peak_tflops.get(precision) or device.peak_tflops["fp32"]
    return tflops * 1e12


def achievable_fraction(device: DeviceSpec, precision: str) -> float:
    """MFU assumed for `device` (CPUs have no compute capability)."""
    if device.compute_capability is None:
        return ACHIEVABLE_FRACTION_CPU.get(precision, ACHIEVABLE_FRACTION_CPU["fp32"])
    return ACHIEVABLE_FRACTION_CUDA


def compute_s(profile: ModelProfile, strategy: Strategy, micro_batch: int, grad_accum: int,
              device: DeviceSpec) -> float:
    """Compute time of one optimizer step on one rank: 3 x forward FLOPs x samples per rank /
    (peak x achievable fraction), x 4/3 with checkpointing."""
    flops = FWD_BWD_FACTOR * profile.flops_fwd_per_sample * micro_batch * grad_accum
    if strategy.activation_checkpointing:
        flops *= CHECKPOINT_RECOMPUTE_FACTOR
    return flops / (peak_flops(device, strategy.precision)
                    * achievable_fraction(device, strategy.precision))


def _phases(strategy: Strategy) -> tuple[float, float]:
    """(forward share, backward share) of a micro-batch's compute; the recompute of a
    checkpointed forward runs inside backward."""
    if strategy.activation_checkpointing:
        return 1 / 4, 3 / 4
    return 1 / 3, 2 / 3


def step_time(profile: ModelProfile, strategy: Strategy, topology: Topology, micro_batch: int,
              grad_accum: int) -> StepTimeEstimate:
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
    """
    device = topology.accelerator
    t_mb = compute_s(profile, strategy, micro_batch, 1, device)
    compute = t_mb * grad_accum
    if topology.world_size <= 1:
        return StepTimeEstimate(compute_s=compute, comm_total_s=0.0, comm_exposed_s=0.0)
    ovl = OVERLAP_EFFICIENCY[topology.device]
    fwd_share, bwd_share = _phases(strategy)
    fwd, bwd = t_mb * fwd_share * ovl, t_mb * bwd_share * ovl  # hideable seconds
    p = float(profile.num_params)
    grad_bytes = GRAD_BYTES * p

    if strategy.kind == "ddp":
        ops = _group(topology)
        buckets = math.ceil(grad_bytes / DDP_BUCKET_CAP_BYTES)
        total = _split(ops["ar"], grad_bytes, buckets)
        exposed = max(ops["ar"](grad_bytes / buckets), total - bwd)
        return StepTimeEstimate(compute_s=compute, comm_total_s=total, comm_exposed_s=exposed)

    c = COMPUTE_DTYPE_BYTES[strategy.precision]
    block = float(profile.largest_block_params)
    root = float(unsharded_root_params(profile))
    nb = max(1, profile.num_blocks)
    units = nb + (1 if root > 0 else 0)
    ops = _group(topology, within_node=strategy.kind == "hybrid")

    ag_fwd = _split(ops["ag"], c * p, units)
    first_ag = ops["ag"](c * (root + block))  # nothing computes before root and block 0 arrive
    ag_bwd = 0.0 if strategy.kind == "fsdp_grad_op" else _split(ops["ag"], c * (p - root), nb)
    rs = _split(ops["rs"], REDUCE_DTYPE_BYTES * p, units)
    last_rs = ops["rs"](REDUCE_DTYPE_BYTES * max(root, block))  # the last unit's grads, at the end
    exposed_fwd = max(first_ag, ag_fwd - fwd)
    exposed_bwd = max(last_rs, ag_bwd + rs - bwd)
    # fixed per-collective cost: cannot overlap (it sits on the compute stream / CPU thread)
    collectives = units + units + (0 if strategy.kind == "fsdp_grad_op" else nb)
    fixed = collectives * FSDP_COLLECTIVE_OVERHEAD_S[topology.device]
    total = grad_accum * (ag_fwd + ag_bwd + rs + fixed)
    exposed = grad_accum * (exposed_fwd + exposed_bwd + fixed)

    if strategy.kind == "hybrid" and topology.num_nodes > 1 and topology.inter_node is not None:
        # G replica groups (one per local rank) all-reduce their 1/G shard at once, sharing
        # the node's network bandwidth; one rank per node, so NCCL may use its tree
        g, m = topology.devices_per_node, topology.num_nodes
        replica = shared_link(topology.inter_node, g)

        def across(s: float) -> float:
            return min(ring_allreduce_s(s, m, replica), tree_allreduce_s(s, m, replica))

        ar = _split(across, grad_bytes / g, units)
        last_ar = across(REDUCE_DTYPE_BYTES * max(root, block) / g)
        exposed_last = max(last_rs + last_ar, ag_bwd + rs + ar - bwd)
        fixed_ar = units * FSDP_COLLECTIVE_OVERHEAD_S[topology.device]
        total += ar + fixed_ar
        exposed += exposed_last - exposed_bwd + fixed_ar
    return StepTimeEstimate(compute_s=compute, comm_total_s=total, comm_exposed_s=exposed)


__all__ = ["ring_allreduce_s", "tree_allreduce_s", "allgather_s", "reduce_scatter_s",
           "hierarchical_allreduce_s", "shared_link", "slowest_link", "compute_s", "step_time",
           "peak_flops", "achievable_fraction", "ACHIEVABLE_FRACTION_CUDA",
           "ACHIEVABLE_FRACTION_CPU", "OVERLAP_EFFICIENCY", "FSDP_COLLECTIVE_OVERHEAD_S",
           "CHECKPOINT_RECOMPUTE_FACTOR", "REDUCE_DTYPE_BYTES"]

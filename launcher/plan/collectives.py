"""What each strategy sends, and how long it takes: the alpha-beta model of NCCL's collectives
(nccl-tests' conventions, PERFORMANCE.md), DDP's bucketed all-reduce (zero1's too, and its
parameter sync after the step) and FSDP's per-unit all-gathers and reduce-scatters with what
compute can hide of them.

Pure arithmetic on the frozen specs: no torch, no I/O; never imports cli, backends or runtime.

Over n ranks, S bytes, bandwidth B = `link.bw_gb_s * 1e9` (the achievable bus bandwidth per
device of the slowest link the ring crosses) and alpha = `link.latency_us * 1e-6` per ring step:

    all-reduce      2(n-1)/n * S/B + 2(n-1) * alpha
    all-gather      (n-1)/n * S/B + (n-1) * alpha      (S = the gathered, full size)
    reduce-scatter  (n-1)/n * S/B + (n-1) * alpha      (S = the full input size)

Across nodes (the convention of topologies/*.yaml): `inter_node.bw_gb_s` is the bus bandwidth a
ring spanning the nodes sees per rank when all G ranks of a node take part, i.e. the node's
aggregate network bandwidth (NCCL spreads its channels over the rails). G collectives that run at
once with one rank per node each (hybrid replicas, the inter-node phase of a hierarchical
all-reduce) share it: each gets bw / G.
- all-gather / reduce-scatter across nodes: NCCL only has ring algorithms for them with several
  ranks per node, so a flat ring over all N ranks at the slowest link's bandwidth and latency
  (ring steps advance in lockstep): the latency term grows linearly with the world size.
- all-reduce across nodes: NCCL's tuner picks ring or tree per message size; we take the fastest
  of the flat ring and the two-level (hierarchical) all-reduce: intra-node reduce-scatter,
  inter-node all-reduce of 1/G of the data (G of them at once on the shared network; a ring, or
  a tree with 2 log2(M) latencies as NCCL's double binary tree has), intra-node all-gather. Its
  phases are summed, not pipelined, which errs slightly on the slow side.

Tensor parallelism of degree t (`Strategy.tp`) inside a node, FSDP over the rest:
- FSDP's collectives run over the data-parallel group (`dp_topology`): world / t ranks, each
  moving its 1/t slice of the parameters. The t groups share the node's network: each sees the
  inter-node bus bandwidth / t (as hybrid's replica groups); NVLink is not shared in this model
  (each rank has its own NVLink ports).
- TP + sequence parallelism (`tp_comm_s`): per block, the forward all-gathers the sequence-split
  activations before attention and before the MLP and reduce-scatters their outputs (2 + 2 of
  b x s x h elements at the compute dtype), backward the same (Korthikanti et al. 2022, s4.2.2),
  plus the embedding's reduce-scatter and the head's all-gather, over the intra-node link. None
  of it is hidden: without async TP each collective sits between the matmuls around it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from launcher.hardware.types import Link, Topology
from launcher.plan import memory
from launcher.plan.activations import COMPUTE_DTYPE_BYTES
from launcher.plan.float8 import fsdp_float8_gather
from launcher.specs import ModelProfile, Strategy

# Fixed cost of each FSDP collective on a GPU's critical path, beyond its alpha-beta time:
# FSDP2's pre-forward/post-backward hooks, the copy-in (chunk_cat) and copy-out
# (split_with_sizes_copy) kernels on the compute stream and the cross-stream waits. The hooks
# cost 0.1-1 ms of CPU per unit (pytorch#173680) but mostly run ahead of the GPU; copy-out of a
# 0.15 GB gather takes ~0.2-0.3 ms (pytorch#115515) -> 50 us per collective. DDP's reducer is
# C++ and its buckets are views: no such term. (CPU ranks: `cpu_comm.fsdp_overhead_s`.)
FSDP_COLLECTIVE_OVERHEAD_S = 50e-6
# Gradients cross the ranks at `Strategy.reduce_bytes`: fp32 by default (FSDP's
# MixedPrecisionPolicy(reduce_dtype=float32), DDP's fp32 .grad buckets), bf16 with `reduce_dtype`.
FLOAT8_BYTES = 1  # a float8 weight's all-gathered bytes a parameter
AMAX_BYTES = 4  # the fp32 amax all-reduced before each float8 weight's gather

Collective = Callable[[float], float]


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


def group_collectives(topology: Topology, *, within_node: bool = False) -> dict[str, Collective]:
    """All-gather ("ag"), reduce-scatter ("rs") and all-reduce ("ar") over all ranks of
    `topology` (or over one node's ranks), each a function of the full size in bytes."""
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


def replica_allreduce(topology: Topology) -> Collective:
    """The all-reduce hybrid shard's replica groups run across nodes: G groups (one per local
    rank) at once, one rank per node each, sharing the node's network; NCCL may use its tree."""
    g, m = topology.devices_per_node, topology.num_nodes
    if m <= 1 or topology.inter_node is None:
        return lambda s: 0.0
    replica = shared_link(topology.inter_node, g)
    return lambda s: min(ring_allreduce_s(s, m, replica), tree_allreduce_s(s, m, replica))


def split(op: Collective, total: float, count: int) -> float:
    """`count` equal collectives moving `total` bytes together (latency paid `count` times)."""
    count = max(1, count)
    return count * op(total / count)


def dp_topology(topology: Topology, tp: int) -> Topology:
    """The data-parallel group of one TP rank as a topology of its own: devices_per_node / tp
    ranks per node, the node's network shared by the tp groups (tp = 1: `topology` itself)."""
    if tp <= 1:
        return topology
    dp = topology.with_shape(num_nodes=topology.num_nodes, devices_per_node=topology.devices_per_node // tp)
    if topology.inter_node is None:
        return dp
    return dataclasses.replace(dp, inter_node=shared_link(topology.inter_node, tp))


# the collectives TP + SP adds per block and pass: all-gather before attention and before the
# MLP, reduce-scatter after each (Korthikanti et al. 2022, Figure 6: g and g-bar)
TP_COLLECTIVES_PER_BLOCK = 4
# outside the blocks: the embedding's output reduce-scatter, the head's input all-gather
TP_COLLECTIVES_OUTSIDE = 2


def tp_comm_s(profile: ModelProfile, strategy: Strategy, topology: Topology, micro_batch: int,
              *, recompute: float = 0.0) -> float:
    """Seconds of one micro-batch's TP + SP activation collectives on one rank: forward,
    backward and the `recompute` share of the forward that checkpointing runs again; each moves
    the micro-batch's full activation (b x s x h at the compute dtype; `block_input_bytes` was
    profiled in fp32) over the intra-node link among `strategy.tp` ranks."""
    t = strategy.tp
    if t <= 1:
        return 0.0
    nbytes = micro_batch * profile.block_input_bytes_per_sample * COMPUTE_DTYPE_BYTES[strategy.precision] / 4
    per_pass = TP_COLLECTIVES_PER_BLOCK * max(1, profile.num_blocks) + TP_COLLECTIVES_OUTSIDE
    # all-gather and reduce-scatter cost the same: (t-1)/t * S/B + (t-1) * alpha
    return (2 + recompute) * per_pass * allgather_s(nbytes, t, topology.intra_node)


def ddp_comm(profile: ModelProfile, strategy: Strategy, topology: Topology, hide_s: float) -> tuple[float, float]:
    """(total, exposed) seconds of DDP's one all-reduce of the grads per step, in 25 MiB buckets
    of fp32 grads (sent at `strategy.reduce_bytes`: the bf16 hook compresses each bucket), behind
    `hide_s` of the last micro-batch's backward; the last bucket is exposed."""
    buckets = math.ceil(memory.GRAD_BYTES * float(profile.num_params) / memory.DDP_BUCKET_CAP_BYTES)
    grad_bytes = strategy.reduce_bytes * float(profile.num_params)
    ops = group_collectives(topology)
    total = split(ops["ar"], grad_bytes, buckets)
    return total, max(ops["ar"](grad_bytes / buckets), total - hide_s)


def zero1_sync_bytes(profile: ModelProfile) -> float:
    """What zero1's parameter sync moves per step: all the parameters, at their stored dtype
    (fp32 under DDP's autocast), each rank sending its 1/n of them."""
    return memory.MASTER_PARAM_BYTES * float(profile.num_params)


def zero1_sync_s(profile: ModelProfile, topology: Topology) -> float:
    """Seconds of zero1's parameter sync after the optimizer step: one all-gather of the flat
    parameter buffer, each rank contributing the even 1/n it stepped (runtime/zero.py). Nothing
    hides it: it follows the optimizer step, after all of the step's compute."""
    return group_collectives(topology)["ag"](zero1_sync_bytes(profile))


def fsdp_units(profile: ModelProfile, strategy: Strategy) -> int:
    """FSDP units (`fully_shard` groups, one all-gather and one reduce-scatter each): one per
    block (each of its linear layers and the rest under `fsdp_unit` linear), the root when parameters
    stay outside the blocks, and under bf16/fp16 one per batch norm (kept in fp32, runtime.wrap); a
    model without blocks is one unit."""
    blocks = profile.num_blocks * memory.units_per_block(profile, strategy)
    units = max(1, blocks) + (1 if memory.unsharded_root_params(profile) > 0 and profile.num_blocks else 0)
    return units + (profile.batch_norms if strategy.precision != "fp32" else 0)


def fsdp_traffic(profile: ModelProfile, strategy: Strategy, topology: Topology) -> dict[str, float]:
    """Seconds of one micro-batch's FSDP collectives: forward all-gathers ("ag_fwd", the first
    of which, "first_ag", nothing can hide), backward all-gathers ("ag_bwd"), reduce-scatters
    ("rs", the last unit's "last_rs" after all compute) and the fixed per-collective cost."""
    # with TP each rank holds (and FSDP moves) its 1/tp slice; x / 1 is exact
    tp = strategy.tp
    p = float(profile.num_params) / tp
    c = COMPUTE_DTYPE_BYTES[strategy.precision]
    block = float(memory.largest_unit_params(profile, strategy)) / tp
    root = float(memory.unsharded_root_params(profile)) / tp
    nb = max(1, profile.num_blocks)
    gathers = nb * memory.units_per_block(profile, strategy)  # the blocks' units, each gathered again in backward
    units = fsdp_units(profile, strategy)
    ops = group_collectives(topology, within_node=strategy.kind == "hybrid")
    grad_op = strategy.kind == "fsdp_grad_op"
    # fixed per-collective cost: cannot overlap (it sits on the compute stream / CPU thread)
    collectives = 2 * units + (0 if grad_op else gathers)
    # float8 weights gather at 1 B, each after an all-reduce of its amax (plan.float8)
    float8_params, weights = fsdp_float8_gather(profile, strategy, topology.accelerator)
    saved = (c - FLOAT8_BYTES) * float8_params
    amax = weights * ops["ar"](AMAX_BYTES) if weights else 0.0
    return {"ag_fwd": split(ops["ag"], c * p - saved, units) + nb * amax,
            "first_ag": ops["ag"](c * (root + block) - saved / gathers) + amax,
            "ag_bwd": 0.0 if grad_op else split(ops["ag"], c * (p - root) - saved, gathers) + nb * amax,
            "rs": split(ops["rs"], strategy.reduce_bytes * p, units),
            "last_rs": ops["rs"](strategy.reduce_bytes * max(root, block)),
            "fixed": collectives * FSDP_COLLECTIVE_OVERHEAD_S,
            "units": units, "last_unit": max(root, block)}


def sharded_comm(profile: ModelProfile, strategy: Strategy, topology: Topology,
                  hide_fwd: float, hide_bwd: float, grad_accum: int) -> tuple[float, float]:
    """(total, exposed) communication of one step of FSDP or hybrid shard over `topology` (with
    TP: the data-parallel group, `dp_topology`)."""
    t = fsdp_traffic(profile, strategy, topology)
    exposed_fwd = max(t["first_ag"], t["ag_fwd"] - hide_fwd)
    exposed_bwd = max(t["last_rs"], t["ag_bwd"] + t["rs"] - hide_bwd)
    total = grad_accum * (t["ag_fwd"] + t["ag_bwd"] + t["rs"] + t["fixed"])
    exposed = grad_accum * (exposed_fwd + exposed_bwd + t["fixed"])
    if strategy.kind == "hybrid" and topology.num_nodes > 1:
        # the last micro-batch's backward also all-reduces each unit's 1/G gradient shard
        # across the replicas; its last unit's all-reduce follows all compute
        g = topology.devices_per_node
        across = replica_allreduce(topology)
        ar = split(across, strategy.reduce_bytes * float(profile.num_params) / strategy.tp / g, int(t["units"]))
        last_ar = across(strategy.reduce_bytes * t["last_unit"] / g)
        last_bwd = max(t["last_rs"] + last_ar, t["ag_bwd"] + t["rs"] + ar - hide_bwd)
        fixed = t["units"] * FSDP_COLLECTIVE_OVERHEAD_S
        total += ar + fixed
        exposed += last_bwd - exposed_bwd + fixed
    return total, exposed


__all__ = ["ring_allreduce_s", "tree_allreduce_s", "allgather_s", "reduce_scatter_s",
           "hierarchical_allreduce_s", "shared_link", "slowest_link", "group_collectives",
           "replica_allreduce", "split", "Collective", "ddp_comm", "fsdp_traffic", "fsdp_units",
           "zero1_sync_bytes", "zero1_sync_s", "FLOAT8_BYTES", "AMAX_BYTES",
           "sharded_comm", "FSDP_COLLECTIVE_OVERHEAD_S", "dp_topology",
           "tp_comm_s", "TP_COLLECTIVES_PER_BLOCK", "TP_COLLECTIVES_OUTSIDE"]

"""What DDP's and FSDP's communication costs CPU ranks, from the gloo probe's measurements.

Gloo cannot hide behind compute on CPU ranks (its threads copy, reduce and move bytes through the
loopback TCP stack on the cores the ranks compute on), so every collective's time is added to the
step: its latency (the wake-ups and scheduling between busy ranks, measured by `gloo_probe`) plus
its bytes at the measured time per byte. Without a measurement (a topology file of another host,
several nodes) the topology's link figures give the alpha-beta time of `collectives`.

- DDP: one all-reduce per bucket of the fp32 gradients per optimizer step (the first bucket 1 MiB,
  the rest 25 MiB each), and the reducer's handling of each (DDP_BUCKET_OPS); at one rank too
  (`cpu_cost`: DDP has no one-rank shortcut).
- zero1: DDP's all-reduce, then one all-gather of the fp32 parameters after the step, each rank
  contributing the even 1/n it stepped (runtime/zero.py; `collectives.zero1_sync_s`'s formula).
- FSDP2 (full shard, grad-op): per micro-batch and unit, an all-gather of the unit's parameters at
  the compute dtype in forward and (full shard) again in backward, and a reduce-scatter of its fp32
  gradients; plus FSDP2's own Python and copies on the rank's core (hooks, DTensor bookkeeping, the
  copies around each collective: FSDP_UNIT_OPS, FSDP_TENSOR_OPS, FSDP_PARAM_BYTES,
  FSDP_COLLECTIVE_OPS). Under bf16 or fp16 each batch norm is a unit of its own (runtime.wrap).
- Hybrid shard: FSDP's traffic within the shard group plus an all-reduce of each unit's 1/G
  gradient shard across the replicas per step.

Pure arithmetic on the frozen specs: no torch, no I/O; never imports cli, backends, jobs, runtime,
results or report.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

from launcher.hardware.types import Topology
from launcher.plan.activations import COMPUTE_DTYPE_BYTES
from launcher.plan.collectives import fsdp_units, group_collectives, replica_allreduce, zero1_sync_bytes
from launcher.plan.cpu_rates import gloo_of, rates_of, time_share
from launcher.plan.memory import DDP_BUCKET_CAP_BYTES, GRAD_BYTES
from launcher.specs import ModelProfile, Strategy

# DDP's first gradient bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)
DDP_FIRST_BUCKET_BYTES = 1024**2
# FSDP2's fixed work per unit and per parameter tensor in one forward + backward, in units of
# the probe's 1-element op: one process on a 2-core EPYC VM (torch 2.13, gloo, world 1, so no
# communication) trained 8 and 16 units of 2 tensors, and 8 units of 8 and 16 tensors, in
# 5.8-28.6 ms more per step than the same model unwrapped: ~0.4 ms per unit and ~0.16 ms per
# tensor against the probe's 2.7 us op
FSDP_UNIT_OPS = 150.0
FSDP_TENSOR_OPS = 60.0
# FSDP2's work per parameter in one forward + backward (copies into and out of the flat
# all-gather and reduce-scatter buffers, their fresh allocations, casts), as bytes at the
# probe's memory bandwidth, on one thread; and its handling of each collective beyond gloo's
# own time (waits on the collective's work handle, the copy-out's bookkeeping), in the probe's
# ops. Joint fit over the 18 FSDP cells of benchmarks/cpu_truth.py (mlp, gpt tiny, resnet; fp32,
# bf16; 1, 2, 4 ranks on a 2-core EPYC VM, torch 2.13, medians of 2 runs): 80 B and 150 ops
# put every cell within 12% (that grid's run, 2026-11-24); neither is fitted per workload
FSDP_PARAM_BYTES = 80.0
FSDP_COLLECTIVE_OPS = 150.0
# DDP's reducer per bucket beyond gloo's own time (marking the bucket ready from the gradient
# hooks, launching the all-reduce, waiting on its future, copying the result back), in the
# probe's ops: workloads/mlp.py (two buckets) at one rank, two threads, on a 2-core EPYC VM
# (torch 2.13) stepped 0.55-0.75 ms slower under DDP than unwrapped, of which the 1-rank gloo
# probe's two all-reduces are ~0.3 ms: ~0.17 ms per bucket against the probe's 2.7 us op
DDP_BUCKET_OPS = 60.0


def ddp_buckets(grad_bytes: float) -> list[float]:
    """Sizes of DDP's gradient buckets: the first up to 1 MiB, the rest up to 25 MiB each."""
    if grad_bytes <= 0:
        return []
    first = min(grad_bytes, DDP_FIRST_BUCKET_BYTES)
    rest = grad_bytes - first
    count = math.ceil(rest / DDP_BUCKET_CAP_BYTES)
    return [first] + [rest / count] * count if count else [first]


def gloo_topology(topology: Topology) -> Topology:
    """The topology with its link slowed by the ranks' share of a core: gloo's copies and
    reductions run on the CPU, so ranks that time-share cores share that work too."""
    share = min(1.0, max(1, topology.cpu_cores_per_node) / topology.devices_per_node)
    if share >= 1.0:
        return topology
    intra = dataclasses.replace(topology.intra_node, bw_gb_s=topology.intra_node.bw_gb_s * share,
                                latency_us=topology.intra_node.latency_us / share)
    return dataclasses.replace(topology, intra_node=intra)


def _ops(topology: Topology, *, within_node: bool = False) -> dict[str, Callable[[float], float]]:
    """Seconds of one all-reduce / all-gather / reduce-scatter of S bytes between the ranks:
    the gloo probe's measurement, else the link's alpha-beta time shared like the cores."""
    gloo = gloo_of(topology)
    if gloo is None:
        return group_collectives(gloo_topology(topology), within_node=within_node)
    return {op: functools.partial(gloo.collective_s, op) for op in ("ar", "ag", "rs")}


def cpu_ddp_comm(profile: ModelProfile, topology: Topology, reduce_bytes: int = GRAD_BYTES) -> float:
    """Seconds of DDP's bucketed all-reduce of the fp32 gradients per optimizer step, with handling; each
    bucket sent at `reduce_bytes` an element (`Strategy.reduce_bytes`: the bf16 hook halves it; its cast and
    copy back are not priced: gpt tiny on 2 ranks measured 0.457 s a step against 0.467 s in fp32, AMD EPYC)."""
    ar = _ops(topology)["ar"]
    handling = DDP_BUCKET_OPS * rates_of(topology.accelerator, topology).op_s * time_share(topology)
    buckets = ddp_buckets(GRAD_BYTES * float(profile.num_params))
    return sum(ar(b * reduce_bytes / GRAD_BYTES) + handling for b in buckets)


def cpu_zero1_sync(profile: ModelProfile, topology: Topology) -> float:
    """Seconds of zero1's parameter all-gather after the step (the fp32 parameters, 1/n from each rank)."""
    return _ops(topology)["ag"](zero1_sync_bytes(profile))


def fsdp_overhead_s(profile: ModelProfile, strategy: Strategy, topology: Topology) -> float:
    """FSDP2's own work in one micro-batch's forward + backward on one rank: per unit and per
    parameter tensor, in the probe's per-op cost, on the rank's share of a core."""
    rates = rates_of(topology.accelerator, topology)
    fixed = (FSDP_UNIT_OPS * fsdp_units(profile, strategy) + FSDP_TENSOR_OPS * profile.param_tensors) * rates.op_s
    per_param = FSDP_PARAM_BYTES * profile.num_params / (rates.mem_gb_s * 1e9)
    return (fixed + per_param) * time_share(topology)


def cpu_sharded_comm(profile: ModelProfile, strategy: Strategy, topology: Topology, grad_accum: int) -> float:
    """Seconds of FSDP's (or hybrid shard's) collectives in one optimizer step."""
    ops = _ops(topology, within_node=strategy.kind == "hybrid")
    units = fsdp_units(profile, strategy)
    per_unit = float(profile.num_params) / units
    gathers = 1 if strategy.kind == "fsdp_grad_op" else 2
    c = COMPUTE_DTYPE_BYTES[strategy.precision]
    handling = FSDP_COLLECTIVE_OPS * rates_of(topology.accelerator, topology).op_s * time_share(topology)
    rs = ops["rs"](strategy.reduce_bytes * per_unit)
    per_mb = units * (gathers * (ops["ag"](c * per_unit) + handling) + rs + handling)
    total = grad_accum * per_mb
    if strategy.kind == "hybrid" and topology.num_nodes > 1:
        total += units * replica_allreduce(topology)(strategy.reduce_bytes * per_unit / topology.devices_per_node)
    return total


__all__ = ["gloo_topology", "cpu_ddp_comm", "cpu_zero1_sync", "cpu_sharded_comm", "fsdp_overhead_s", "ddp_buckets",
           "DDP_FIRST_BUCKET_BYTES", "FSDP_UNIT_OPS", "FSDP_TENSOR_OPS", "FSDP_PARAM_BYTES",
           "FSDP_COLLECTIVE_OPS", "DDP_BUCKET_OPS"]

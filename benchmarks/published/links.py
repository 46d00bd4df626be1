"""A topology's inter-node link from the collectives its cluster measured, not from its NICs' line rate.

topologies/h100-sxm-8x64node-efa.yaml (the Ultra-Scale Playbook's H100 cluster on AWS EFA, which
benchmarks/published's `playbook-*` rows ran on) takes its bandwidth and per-ring-step latency from
the playbook's own measurements: the median bus bandwidth of a 256 MB all-reduce and all-gather on
2-64 nodes of 8 GPUs (its Pipeline Parallelism section, "Inter-node communication bandwidth
measurements across different node counts"; read as nccl-tests bus bandwidth, as its appendix A3
computes bandwidths). This fits (bandwidth, latency) to them through dlaunch's own collective
formulas (launcher.plan.collectives) by least squares of the log error, prints each point against
the fit, and exits 1 when the shipped topology is not that fit. Never fitted on throughput rows.

    python benchmarks/published/links.py
"""

from __future__ import annotations

import dataclasses
import math
import sys

from launcher.hardware.topology import load_topology
from launcher.hardware.types import Topology
from launcher.plan.collectives import group_collectives

TOPOLOGY = "h100-sxm-8x64node-efa"
MESSAGE_BYTES = 256 * 2**20
# nodes -> median bus bandwidth, GB/s (the playbook's figure, 8 GPUs a node)
ALL_REDUCE = {2: 361.7, 4: 160.1, 8: 99.6, 16: 84.7, 32: 64.9, 64: 32.9}
ALL_GATHER = {2: 184.6, 4: 119.0, 8: 69.0, 16: 55.0, 32: 28.0, 64: 11.0}
BW_GRID = range(50, 505, 5)  # GB/s
LATENCY_GRID = [x / 2 for x in range(10, 121)]  # 5-60 us


def measured_s(op: str, nodes: int, per_node: int) -> float:
    """Seconds of the measured collective: bus bandwidth back to time (nccl-tests' PERFORMANCE.md)."""
    n = nodes * per_node
    busbw = (ALL_REDUCE if op == "ar" else ALL_GATHER)[nodes] * 1e9
    return (2 if op == "ar" else 1) * MESSAGE_BYTES * (n - 1) / n / busbw


def modelled_s(topo: Topology, op: str, nodes: int, bw_gb_s: float, latency_us: float) -> float:
    """Seconds dlaunch prices the collective at on `nodes` nodes of `topo` with that inter-node link."""
    assert topo.inter_node is not None
    link = dataclasses.replace(topo.inter_node, bw_gb_s=bw_gb_s, latency_us=latency_us)
    shaped = dataclasses.replace(topo.with_shape(num_nodes=nodes, devices_per_node=topo.devices_per_node),
                                 inter_node=link)
    return group_collectives(shaped)[op](MESSAGE_BYTES)


def squared_log_error(topo: Topology, bw_gb_s: float, latency_us: float, ops: tuple[str, ...]) -> float:
    return sum(math.log(modelled_s(topo, op, nodes, bw_gb_s, latency_us)
                        / measured_s(op, nodes, topo.devices_per_node)) ** 2
               for op in ops for nodes in ALL_REDUCE)


def fit(topo: Topology, ops: tuple[str, ...] = ("ar", "ag")) -> tuple[float, float]:
    """(GB/s, us) on the grid that minimises the squared log error over `ops`' measured points."""
    return min(((bw, lat) for bw in BW_GRID for lat in LATENCY_GRID),
               key=lambda p: squared_log_error(topo, p[0], p[1], ops))


def main() -> int:
    topo = load_topology(TOPOLOGY)
    assert topo.inter_node is not None
    shipped = (topo.inter_node.bw_gb_s, topo.inter_node.latency_us)
    both, gathers = fit(topo), fit(topo, ("ag",))
    for name, (bw, lat) in (("both collectives (shipped)", both), ("all-gathers alone", gathers)):
        print(f"fit to {name}: {bw:g} GB/s, {lat:g} us per ring step")
        for nodes in ALL_REDUCE:
            cells = [f"{op} {modelled_s(topo, op, nodes, bw, lat) * 1e3:6.2f} ms / "
                     f"{measured_s(op, nodes, topo.devices_per_node) * 1e3:6.2f} measured "
                     f"({modelled_s(topo, op, nodes, bw, lat) / measured_s(op, nodes, topo.devices_per_node) - 1:+.0%})"
                     for op in ("ar", "ag")]
            print(f"  {nodes:>2} nodes  " + "   ".join(cells))
    if shipped != both:
        print(f"{TOPOLOGY}: the shipped link {shipped} is not the fit {both}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

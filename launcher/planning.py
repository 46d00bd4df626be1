"""Glue between a workload file, a topology and the pure planner (no argv here).

`resolve_topology` picks the hardware to plan for (a topology file, or this machine), reshaped
to the requested GPUs and nodes; `plan_workload` profiles the workload on the meta device and
plans it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from launcher.errors import UsageError
from launcher.specs import Goal, ModelProfile, Plan, Topology

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Planned:
    """A plan with what it was made from."""

    plan: Plan
    profile: ModelProfile
    topology: Topology


def resolve_topology(*, topology: str | None, gpus: int | None, nodes: int | None) -> Topology:
    """The topology file (or this machine), with `gpus` per node and `nodes` nodes."""
    if topology is not None:
        from launcher.topology import load_topology

        topo = load_topology(topology)
        source = f"topology {topo.name}"
    else:
        from launcher.detect import detect_topology

        topo = detect_topology()
        source = "this machine"
    per_node = topo.devices_per_node if gpus is None else gpus
    if topo.device == "cuda" and per_node > topo.devices_per_node:
        raise UsageError(f"--gpus {per_node} is more than {source} has per node "
                         f"({topo.devices_per_node}); use --gpus {topo.devices_per_node} or fewer")
    num_nodes = topo.num_nodes if nodes is None else nodes
    if num_nodes > 1 and topo.inter_node is None:
        raise UsageError(f"--nodes {num_nodes}: {source} describes no link between nodes; "
                         "give a multi-node --topology file (ls topologies/)")
    if (per_node, num_nodes) != (topo.devices_per_node, topo.num_nodes):
        topo = topo.with_shape(num_nodes=num_nodes, devices_per_node=per_node)
    return topo


def plan_workload(workload: str, workload_args: Sequence[str], topology: Topology, goal: Goal, *,
                  overrides: Mapping[str, Any] | None = None) -> Planned:
    """Profile `workload` on the meta device and plan it for `topology`."""
    from launcher.planner import plan
    from launcher.profile import profile_workload
    from launcher.workload import load_workload

    profile = profile_workload(load_workload(workload, workload_args))
    return Planned(plan=plan(profile, topology, goal, overrides=overrides), profile=profile,
                   topology=topology)

"""The planner's prediction beside a report's measurement.

Each world size's predicted step time and throughput come from the plan its run followed
(plan.json, written by `dlaunch run`) when there is one, else from the planner run on the
report's topology for that run's spec and node shape. Optional by design: a report without a
topology or with a workload that no longer profiles still shows every measurement.

Never imports cli, backends, jobs or runtime.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from launcher.hardware.types import Topology
from launcher.plan.kernels import given as given_kernels
from launcher.plan.planfile import read_plan
from launcher.plan.resolve import cached_profiled
from launcher.plan.search import plan
from launcher.plan.types import Overrides
from launcher.report.runs import RunData
from launcher.report.types import Row, efficiency
from launcher.specs import Goal

log = logging.getLogger(__name__)


def _from_plan(row: Row, plan: Mapping[str, Any]) -> bool:
    """Take a row's prediction from the plan its run followed (plan.json); False if unusable."""
    try:
        planned = read_plan(plan)
    except (KeyError, TypeError, ValueError):
        return False
    if planned.time is None or planned.units_per_s is None:
        return False
    row.predicted_step_time_s = planned.time.step_time_s
    row.predicted_samples_per_s = planned.units_per_s / max(1, planned.units_per_sample)
    row.predicted_interval_s = planned.interval[:2] if planned.interval else None
    return True


def predict(rows: list[Row], data: RunData | None, topology: Topology | None, mode: str, n0: int | None,
            plans: Mapping[int, Mapping[str, Any]] | None = None, *,
            nodes: Mapping[int, int] | None = None) -> str | None:
    """Fill the rows' predicted columns: from the plan each run followed (plan.json) where
    there is one, else from the planner's cost model for the run's spec on `topology`, shaped
    as the run was (`nodes`: world size -> nodes it ran on). Returns a note when some row has no
    prediction; any failure here leaves the measurement untouched."""
    todo = [r for r in rows if not (plans and r.world_size in plans and _from_plan(r, plans[r.world_size]))]
    note = _predict_with_planner(todo, data, topology, nodes or {}) if todo else None
    base = next((r for r in rows if r.world_size == n0), rows[0] if rows else None)
    for row in rows:
        if base and base.predicted_samples_per_s and row.predicted_samples_per_s:
            row.predicted_efficiency = efficiency(
                mode, n0=base.world_size, n=row.world_size, throughput_n0=base.predicted_samples_per_s,
                throughput_n=row.predicted_samples_per_s, step_n0=base.predicted_step_time_s,
                step_n=row.predicted_step_time_s)
    return note


def _shape(topology: Topology, world_size: int, num_nodes: int | None) -> Topology:
    """`topology` with the run's node shape: as it ran when known, else whole nodes of the
    topology's size for GPUs, one host for CPU processes."""
    dpn = topology.devices_per_node
    if num_nodes and num_nodes > 1 and world_size % num_nodes == 0 and topology.inter_node:
        return topology.with_shape(num_nodes=num_nodes, devices_per_node=world_size // num_nodes)
    if (num_nodes is None and topology.device != "cpu" and world_size > dpn and world_size % dpn == 0
            and topology.inter_node):
        return topology.with_shape(num_nodes=world_size // dpn, devices_per_node=dpn)
    return topology.with_shape(num_nodes=1, devices_per_node=world_size)


def _predict_with_planner(rows: list[Row], data: RunData | None, topology: Topology | None,
                          nodes: Mapping[int, int]) -> str | None:
    if topology is None:
        return ("prediction unavailable: no topology recorded for this run (pass --topology "
                "FILE, or run the report on the host that ran it)")
    if data is None or data.spec is None or data.spec.is_script:
        return "prediction unavailable: no workload spec (plain scripts are not profiled)"
    spec = data.spec
    try:
        profile = cached_profiled(spec.workload, spec.workload_args).profile
        for row in rows:
            n = row.world_size
            topo = _shape(topology, n, nodes.get(n))
            per_rank = (row.global_batch or spec.micro_batch * spec.grad_accum * n) // n
            mb = spec.micro_batch if per_rank % spec.micro_batch == 0 else per_rank
            kind = spec.strategy if topo.num_nodes > 1 or spec.strategy != "hybrid" else "fsdp_full"
            p = plan(profile, topo, Goal(global_batch=per_rank * n), overrides=Overrides(
                strategy=kind, precision=spec.precision, micro_batch=mb, checkpointing=spec.checkpointing,
                offload=spec.offload, float8=spec.float8, reduce_dtype=spec.reduce_dtype,
                fsdp_unit=spec.fsdp_unit, **given_kernels(spec)))
            row.predicted_step_time_s = p.chosen.time.step_time_s
            row.predicted_interval_s = (p.step_interval.low_s, p.step_interval.high_s) if p.step_interval else None
            row.predicted_samples_per_s = p.units_per_s / profile.units_per_sample
    except Exception as e:  # the planner is optional here: never lose the measurement to it
        log.debug("prediction failed", exc_info=True)
        for row in rows:
            row.predicted_step_time_s = row.predicted_samples_per_s = None
        first = str(e).splitlines()[0] if str(e) else ""
        return f"prediction unavailable: {type(e).__name__}: {first}"[:300]
    return None

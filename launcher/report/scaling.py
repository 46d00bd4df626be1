"""Scaling numbers from a sweep directory (or one run directory): pure, no matplotlib.

Per point: throughput (samples/s and units/s), the step-time breakdown, per-rank step-time
distributions (grouped when there are many ranks), stragglers, busbw beside the link bandwidth
and a bottleneck verdict. Per world size (median over repeats): scaling efficiency
(`types.efficiency`: weak keeps the per-rank batch, strong the global batch), with N0 the
smallest world size measured (1 in a usual sweep); and the planner's prediction beside the
measurement when it can be had (`report.predict`).

Step-time breakdown: seconds per optimizer step (mean over steady steps, then over ranks) of
compute, exposed comm, data wait and other, as `results.verdict.step_parts` splits a step (the
run's own verdict uses it too). The verdict card, the run table and the breakdown figure all
show these shares. A plain script has no breakdown (only its step times are measured).

Never imports cli, backends, jobs, runtime or matplotlib.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from launcher.errors import DlaunchError
from launcher.hardware.types import Topology
from launcher.report.predict import predict
from launcher.report.runs import RunData, discover, group_distributions, read_run
from launcher.report.types import PARTS, Point, Row, ScalingReport, efficiency
from launcher.results.plausibility import superlinear_warning
from launcher.results.prediction import compare, measured_peak_bytes
from launcher.results.table import no_steps, status_text
from launcher.results.types import RunResult
from launcher.results.verdict import NOT_MEASURED, detect_stragglers, step_parts, verdict


def breakdown(data: RunData) -> dict[str, float]:
    """Seconds per step by part (PARTS), averaged over the ranks that recorded steady steps.
    Batch wait per step is the rank's data-wait share (aggregate) times its mean step."""
    accum = data.spec.grad_accum if data.spec is not None else 1
    shares = {x.rank: x.data_wait_share for x in data.result.ranks} if data.result else {}
    per_rank = []
    for rank, times in data.step_times.items():
        if not times:
            continue
        comm = data.comm.get(rank, {})
        per_rank.append(step_parts(math.fsum(times) / len(times), data_wait_share=shares.get(rank, 0.0),
                                   exposed_comm_s=comm.get("exposed_comm_s"), nosync_step_s=comm.get("nosync_step_s"),
                                   accum=accum, tp_comm_s=comm.get("tp_comm_s")))
    if not per_rank:
        return {**{p: 0.0 for p in PARTS}, "step": 0.0}
    return {k: math.fsum(r[k] for r in per_rank) / len(per_rank) for k in (*PARTS, "step")}


def _link_for(topology: Topology | None, world_size: int,
              num_nodes: int | None = None) -> tuple[str | None, float | None]:
    """(kind, GB/s) of the link bounding a ring over `world_size` ranks: the intra-node link,
    or, once the ring crosses nodes, the inter-node link at the lower of the two bandwidths
    (as cost.slowest_link). Without the run's `num_nodes`, GPU rings cross nodes beyond one
    node's devices and CPU processes share one host."""
    if topology is None:
        return None, None
    intra, inter = topology.intra_node, topology.inter_node
    crosses = (num_nodes > 1 if num_nodes is not None
               else world_size > topology.devices_per_node and topology.device != "cpu")
    if crosses and inter is not None:
        return inter.kind, min(intra.bw_gb_s, inter.bw_gb_s)
    return intra.kind, intra.bw_gb_s


def build_point(data: RunData, *, name: str, world_size: int, repeat: int, topology: Topology | None,
                manifest_status: str | None = None, manifest_error: str | None = None) -> Point:
    """The report's view of one run."""
    r, spec = data.result, data.spec
    point = Point(name=name, world_size=world_size, repeat=repeat, run_dir=str(data.run_dir),
                  status=r.status if r is not None else (manifest_status or "missing"),
                  error=manifest_error, unreadable=list(data.notes))
    if spec is not None:
        point.global_batch, point.micro_batch, point.num_nodes = spec.global_batch, spec.micro_batch, spec.nodes
    if r is None:
        return point
    parts = breakdown(data) if r.strategy != "script" else {"step": 0.0}
    step = parts.pop("step")
    kind, bw = _link_for(topology, world_size, spec.nodes if spec is not None else None)
    point.run_id, point.samples_per_s, point.units_per_s = r.run_id, r.samples_per_s, r.units_per_s
    point.status_text, point.sample_units, point.step_time_s = status_text(r), r.sample_units, r.step_time_median_s
    point.breakdown_s, point.shares = parts, {k: v / step for k, v in parts.items()} if step else {}
    point.exposed_comm_s, point.busbw_gb_s = r.exposed_comm_s, r.busbw_gb_s
    point.link_kind, point.link_bw_gb_s = kind, bw
    if bw and r.busbw_gb_s is not None and r.busbw_gb_s <= bw:
        point.busbw_of_link = r.busbw_gb_s / bw
    elif bw and r.busbw_gb_s is not None:
        # more than the link carries: the topology's figure (a datasheet value or an assumption)
        # is wrong for this machine, so a share of it would mislead
        point.warnings.append(f"measured busbw {r.busbw_gb_s:.3g} GB/s exceeds the topology's "
                              f"{kind} figure of {bw:g} GB/s (an assumption, not a measurement): "
                              "no share of it is shown")
    point.stragglers = stragglers(data, r)
    point.verdict = _verdict(r, point.shares)
    if point.stragglers and point.verdict.get("name") == "communication bound":
        point.verdict["evidence"] += ("; part of it is waiting for straggler rank(s) "
                                      + ", ".join(str(s["rank"]) for s in point.stragglers))
    point.distribution = group_distributions(data, r, {s["rank"] for s in point.stragglers})
    point.failures = list(r.failures)
    point.unreadable = list(dict.fromkeys([*r.unreadable, *data.notes]))
    point.prediction = dict(r.prediction) if r.prediction else _prediction(data, r)
    point.warnings = [*r.warnings, *point.warnings]
    return point


def _verdict(r: RunResult, shares: Mapping[str, float]) -> dict[str, str]:
    """The point's verdict from the same shares the table and the breakdown show (one source
    for the numbers), unless the run's own verdict rests on what the shares do not hold: a
    CUDA profile (launch bound) or a plain script (not measured)."""
    own = r.verdict or {}
    own_name = str(own.get("name", ""))
    if own_name and (not shares or own_name in ("launch bound", NOT_MEASURED)):
        return {"name": own_name, "evidence": str(own.get("evidence", "")), "source": "run"}
    if not shares or no_steps(r):
        return {}
    comm_measured = r.world_size == 1 or r.exposed_comm_s is not None
    name, evidence = verdict({**shares, "exposed_comm": shares.get("exposed_comm") if comm_measured else None})
    return {"name": name, "evidence": evidence, "source": "step-time breakdown"}


def _prediction(data: RunData, r: RunResult) -> dict[str, Any]:
    """Predicted against measured for a result.json written before it carried the block."""
    if data.spec is None:
        return {"available": False, "reason": "no launch spec"}
    return compare(data.plan, data.spec, step_time_s=r.step_time_median_s or None,
                   peak_mem_bytes=measured_peak_bytes(r.ranks, r.device), device=r.device)


def stragglers(data: RunData, result: Any) -> list[dict[str, Any]]:
    """Slow ranks by `results.verdict.detect_stragglers` (step time, or own compute from the
    sync-off calibration), each with the numbers of the rule that flagged it."""
    ranks = {x.rank: x for x in result.ranks}
    medians = {x.rank: x.step_time_median_s for x in result.ranks if x.steady_steps}
    busy = {r: float(c["nosync_step_s"]) for r, c in data.comm.items() if c.get("nosync_step_s") is not None}
    return [{"rank": s.rank, "host": ranks[s.rank].host, "node_rank": ranks[s.rank].node_rank,
             "local_rank": ranks[s.rank].local_rank, "median_s": ranks[s.rank].step_time_median_s,
             "busy_s": busy.get(s.rank), "rule": s.rule, "signal": f"{s.rule}: {s.evidence()}"}
            for s in detect_stragglers(medians, busy)]


def _rows(points: list[Point], mode: str) -> tuple[list[Row], int | None]:
    by_ws: dict[int, list[Point]] = {}
    for p in points:
        by_ws.setdefault(p.world_size, []).append(p)
    rows = []
    for n in sorted(by_ws):
        ok = [p for p in by_ws[n] if p.status == "ok" and p.samples_per_s > 0]
        row = Row(world_size=n, repeats_ok=len(ok), repeats=len(by_ws[n]))
        if ok:
            thr = [p.samples_per_s for p in ok]
            row.samples_per_s = statistics.median(thr)
            row.samples_per_s_min, row.samples_per_s_max = min(thr), max(thr)
            row.units_per_s = statistics.median([p.units_per_s for p in ok])
            row.step_time_s = statistics.median([p.step_time_s for p in ok])
            row.global_batch = ok[0].global_batch
        rows.append(row)
    base = next((r for r in rows if r.samples_per_s), None)
    if base is None:
        return rows, None
    assert base.samples_per_s is not None  # narrowing: base was picked for having one
    n0 = base.world_size
    for row in rows:
        if not row.samples_per_s:
            continue
        row.ideal_samples_per_s = base.samples_per_s * row.world_size / n0
        row.efficiency = efficiency(mode, n0=n0, n=row.world_size, throughput_n0=base.samples_per_s,
                                    throughput_n=row.samples_per_s, step_n0=base.step_time_s, step_n=row.step_time_s)
    return rows, n0


def build_report(path: str | Path, *, topology: Topology | None = None,
                 default_topology: Topology | None = None, with_prediction: bool = True) -> ScalingReport:
    """Read a sweep, run or tune directory, or a directory of runs, into a ScalingReport;
    DlaunchError (one line) when it holds no run. The topology (link bandwidth, prediction) is
    `topology` if given, else the one the sweep recorded, else `default_topology`."""
    target = discover(Path(path))
    topo = topology or target.topology or default_topology
    points: list[Point] = []
    first_data: RunData | None = None
    plans: dict[int, dict[str, Any]] = {}
    for entry in target.entries:
        if not entry.run_dir.exists():
            points.append(Point(name=entry.name, world_size=entry.world_size, repeat=entry.repeat,
                                status=entry.status or "missing", run_dir=str(entry.run_dir), error=entry.error))
            continue
        data = read_run(entry.run_dir)
        if first_data is None and data.spec is not None:
            first_data = data
        if data.plan is not None:
            plans.setdefault(entry.world_size, data.plan)
        points.append(build_point(data, name=entry.name, world_size=entry.world_size, repeat=entry.repeat,
                                  topology=topo, manifest_status=entry.status, manifest_error=entry.error))
    if not any(p.status != "missing" or p.run_id for p in points) and target.kind != "sweep":
        why = next((n for p in points for n in p.unreadable), "")
        raise DlaunchError(f"no readable run in {path}" + (f": {why}" if why else ""))
    mode = target.mode or _infer_mode(points)
    rows, n0 = _rows(points, mode)
    if target.kind == "run":  # one run has nothing to be efficient relative to
        for row in rows:
            row.efficiency = row.ideal_samples_per_s = None
    if target.kind == "tune":  # candidates on one world size: the tune's table, not scaling rows
        rows, n0 = [], None
        note: str | None = None  # each trial's prediction is its own plan.json's
    elif with_prediction:
        nodes = {p.world_size: p.num_nodes for p in points if p.num_nodes}
        note = predict(rows, first_data, topo, mode, n0, plans, nodes=nodes)
    else:
        note = "prediction skipped"

    warnings = [f"{p.name}: {w}" for p in points for w in p.warnings]
    if n0 is not None:
        warnings += [w for row in rows for w in (superlinear_warning(row.world_size, row.efficiency, n0),
                                                  superlinear_warning(row.world_size, row.predicted_efficiency, n0,
                                                                      predicted=True)) if w is not None]
    link_note = None if topo is not None else "link bandwidth unknown: no topology recorded (pass --topology FILE)"
    return ScalingReport(kind=target.kind, source=str(Path(path).absolute()), mode=mode,
                         sample_units=next((p.sample_units for p in points if p.run_id), "samples"),
                         baseline_world_size=n0, rows=rows, points=points, prediction_note=note,
                         link_note=link_note, notes=target.notes, warnings=warnings, tune=target.tune)


def _infer_mode(points: Sequence[Point]) -> str:
    """Runs gathered without a manifest: the same global batch everywhere means strong."""
    batches = {p.global_batch for p in points if p.global_batch}
    sizes = {p.world_size for p in points}
    return "strong" if len(batches) == 1 and len(sizes) > 1 else "weak"

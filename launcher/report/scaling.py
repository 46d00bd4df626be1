"""Scaling numbers from a sweep directory (or one run directory): pure, no matplotlib.

Per point: throughput (samples/s and units/s), the step-time breakdown, per-rank step-time
distributions (grouped when there are many ranks), stragglers, busbw beside the link bandwidth
and a bottleneck verdict. Per world size (median over repeats): scaling efficiency, weak
(fixed per-rank batch) throughput(N) / (N x throughput(N0)) or strong (fixed global batch)
T(N0) x N0 / (N x T(N)), with N0 the smallest world size measured (1 in a usual sweep); and the
planner's prediction beside the measurement when it can be had (`report.predict`).

Step-time breakdown (seconds per optimizer step, mean over steady steps, then over ranks):
  data wait      time the loop waited for the next batch (measured every step)
  exposed comm   what the step loses to gradient sync (the sync-off/on calibration)
  other          step - wait - exposed - forward/backward with sync off (x accumulation steps):
                 the optimizer step and host overhead; 0 when the calibration did not run
  compute        the rest: step - wait - exposed - other
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.errors import DlaunchError
from launcher.report.runs import GROUP_LIMIT, RunData, discover, group_distributions, read_run
from launcher.results.aggregate import busy_stragglers, percentile
from launcher.specs import Topology

log = logging.getLogger(__name__)

DATA_BOUND_SHARE = 0.20  # batch wait above this share of the step: data-loading bound
COMM_BOUND_SHARE = 0.25  # exposed communication above this share: communication bound
PARTS = ("compute", "exposed_comm", "data_wait", "other")


def verdict(shares: Mapping[str, float]) -> tuple[str, str]:
    """The bottleneck of a run from its step-time shares (keys of PARTS, fractions of the
    step): (name, evidence). Data wait > 20% -> data-loading bound; exposed communication
    > 25% -> communication bound; else compute bound."""
    wait, comm = shares.get("data_wait", 0.0), shares.get("exposed_comm", 0.0)
    if wait > DATA_BOUND_SHARE:
        return ("data-loading bound",
                f"waiting for batches is {wait:.0%} of the step (> {DATA_BOUND_SHARE:.0%}); "
                "add DataLoader workers (--num-workers) or make batches cheaper")
    if comm > COMM_BOUND_SHARE:
        return ("communication bound",
                f"exposed communication is {comm:.0%} of the step (> {COMM_BOUND_SHARE:.0%}); "
                "a larger per-rank batch, gradient accumulation or a faster link would help")
    return ("compute bound", f"compute is {shares.get('compute', 0.0):.0%} of the step, data "
                             f"wait {wait:.0%}, exposed communication {comm:.0%}")


def breakdown(data: RunData) -> dict[str, float]:
    """Seconds per step by part (PARTS), averaged over the ranks that recorded steady steps.
    Batch wait per step is the rank's data-wait share (aggregate) times its mean step."""
    accum = data.spec.grad_accum_steps if data.spec is not None else 1
    shares = {x.rank: x.data_wait_share for x in data.result.ranks} if data.result else {}
    per_rank = []
    for rank, times in data.step_times.items():
        if not times:
            continue
        step = math.fsum(times) / len(times)
        wait = min(step, max(0.0, shares.get(rank, 0.0)) * step)
        comm = data.comm.get(rank, {})
        exposed = min(max(0.0, comm.get("exposed_comm_s") or 0.0), step - wait)
        nosync = comm.get("nosync_step_s")
        other = max(0.0, step - wait - exposed - nosync * accum) if nosync is not None else 0.0
        per_rank.append({"compute": max(0.0, step - wait - exposed - other),
                         "exposed_comm": exposed, "data_wait": wait, "other": other, "step": step})
    if not per_rank:
        return {**{p: 0.0 for p in PARTS}, "step": 0.0}
    return {k: math.fsum(r[k] for r in per_rank) / len(per_rank) for k in (*PARTS, "step")}


def _link_for(topology: Topology | None, world_size: int,
              num_nodes: int | None = None) -> tuple[str | None, float | None]:
    """(kind, GB/s) of the link bounding a ring over `world_size` ranks: the intra-node link,
    or, once the ring crosses nodes, the inter-node link at the lower of the two bandwidths
    (as cost.slowest_link). The run's `num_nodes` when known, else a guess: GPU rings cross
    nodes beyond one node's devices, CPU processes share one host."""
    if topology is None:
        return None, None
    intra, inter = topology.intra_node, topology.inter_node
    crosses = (num_nodes > 1 if num_nodes is not None
               else world_size > topology.devices_per_node and topology.device != "cpu")
    if crosses and inter is not None:
        return inter.kind, min(intra.bw_gb_s, inter.bw_gb_s)
    return intra.kind, intra.bw_gb_s


@dataclass(kw_only=True)
class Point:
    """One run of a sweep (or the lone run of a run directory), with what the report shows."""

    name: str
    world_size: int
    repeat: int
    status: str
    run_dir: str
    run_id: str = ""
    num_nodes: int | None = None  # from the run's launch spec
    global_batch: int | None = None
    micro_batch: int | None = None
    samples_per_s: float = 0.0
    units_per_s: float = 0.0
    sample_units: str = "samples"
    step_time_s: float = 0.0
    breakdown_s: dict[str, float] = field(default_factory=dict)
    shares: dict[str, float] = field(default_factory=dict)
    exposed_comm_s: float | None = None
    busbw_gb_s: float | None = None
    link_kind: str | None = None
    link_bw_gb_s: float | None = None
    busbw_of_link: float | None = None
    stragglers: list[dict[str, Any]] = field(default_factory=list)
    verdict: dict[str, str] = field(default_factory=dict)
    distribution: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)
    error: str | None = None


@dataclass(kw_only=True)
class Row:
    """One world size: the median over its ok repeats, the efficiency, the prediction."""

    world_size: int
    repeats_ok: int
    repeats: int
    samples_per_s: float | None = None
    samples_per_s_min: float | None = None
    samples_per_s_max: float | None = None
    units_per_s: float | None = None
    step_time_s: float | None = None
    global_batch: int | None = None
    efficiency: float | None = None
    ideal_samples_per_s: float | None = None
    predicted_step_time_s: float | None = None
    predicted_samples_per_s: float | None = None
    predicted_efficiency: float | None = None


@dataclass(kw_only=True)
class ScalingReport:
    """Everything `dlaunch report` shows, as plain values (report.json is its asdict)."""

    kind: str  # sweep | run | runs
    source: str
    mode: str  # weak | strong
    sample_units: str
    baseline_world_size: int | None
    rows: list[Row]
    points: list[Point]
    prediction_note: str | None = None
    link_note: str | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return dataclasses.asdict(self)


def build_point(data: RunData, *, name: str, world_size: int, repeat: int,
                topology: Topology | None, manifest_status: str | None = None,
                manifest_error: str | None = None) -> Point:
    """The report's view of one run."""
    r = data.result
    spec = data.spec
    point = Point(name=name, world_size=world_size, repeat=repeat, run_dir=str(data.run_dir),
                  status=r.status if r is not None else (manifest_status or "missing"),
                  error=manifest_error, unreadable=list(data.notes))
    if spec is not None:
        point.global_batch, point.micro_batch = spec.global_batch, spec.micro_batch
        point.num_nodes = spec.num_nodes
    if r is None:
        return point
    parts = breakdown(data)
    step = parts.pop("step")
    kind, bw = _link_for(topology, world_size, spec.num_nodes if spec is not None else None)
    point.run_id, point.samples_per_s, point.units_per_s = r.run_id, r.samples_per_s, r.units_per_s
    point.sample_units, point.step_time_s = r.sample_units, r.step_time_median_s
    point.breakdown_s = parts
    point.shares = {k: (v / step if step else 0.0) for k, v in parts.items()}
    point.exposed_comm_s, point.busbw_gb_s = r.exposed_comm_s, r.busbw_gb_s
    point.link_kind, point.link_bw_gb_s = kind, bw
    if bw and r.busbw_gb_s is not None:
        point.busbw_of_link = r.busbw_gb_s / bw
    point.stragglers = stragglers(data, r)
    if isinstance(data.verdict, Mapping) and data.verdict.get("name"):
        v = data.verdict  # the run's own verdict (aggregate.run_verdict, or a runtime's)
        point.verdict = {"name": str(v["name"]), "evidence": str(v.get("evidence", "")),
                         "source": "run"}
    elif isinstance(data.verdict, str) and data.verdict:
        point.verdict = {"name": data.verdict, "evidence": "", "source": "run"}
    elif step:
        name_, evidence = verdict(point.shares)
        point.verdict = {"name": name_, "evidence": evidence, "source": "step-time shares"}
    if point.stragglers and point.verdict.get("name") == "communication bound":
        point.verdict["evidence"] += ("; part of it is waiting for straggler rank(s) "
                                      + ", ".join(str(s["rank"]) for s in point.stragglers))
    point.distribution = group_distributions(data, r, {s["rank"] for s in point.stragglers})
    point.failures = list(r.failures)
    point.unreadable = list(dict.fromkeys([*r.unreadable, *data.notes]))
    return point


def stragglers(data: RunData, result: Any) -> list[dict[str, Any]]:
    """Slow ranks, by two signals: the aggregate's (median step time > 110% of the median of
    medians) and each rank's own forward+backward with gradient sync off, from the
    calibration. The second one matters under DDP: every step ends in an all-reduce, so all
    ranks share the slow rank's step time and only the time before the sync tells them apart
    (the others' wait for it shows up as their exposed communication)."""
    ranks = {x.rank: x for x in result.ranks}
    busy = {r: float(c["nosync_step_s"]) for r, c in data.comm.items()
            if c.get("nosync_step_s") is not None}
    mid = statistics.median(busy.values()) if busy else 0.0
    slow_busy = busy_stragglers(busy)
    out = []
    for r in sorted(set(result.stragglers) | slow_busy):
        if r not in ranks:
            continue
        x = ranks[r]
        signals = ([] if r not in result.stragglers else ["step time"]) + (
            [f"own forward+backward {1000 * busy[r]:.1f} ms vs {1000 * mid:.1f} ms median "
             "(sync-off calibration)"] if r in slow_busy else [])
        out.append({"rank": r, "host": x.host, "node_rank": x.node_rank,
                    "local_rank": x.local_rank, "median_s": x.step_time_median_s,
                    "busy_s": busy.get(r), "signal": "; ".join(signals)})
    return out


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
    n0 = base.world_size
    for row in rows:
        if not row.samples_per_s:
            continue
        row.ideal_samples_per_s = base.samples_per_s * row.world_size / n0
        row.efficiency = efficiency(mode, n0=n0, n=row.world_size,
                                    throughput_n0=base.samples_per_s, throughput_n=row.samples_per_s,
                                    step_n0=base.step_time_s, step_n=row.step_time_s)
    return rows, n0


def efficiency(mode: str, *, n0: int, n: int, throughput_n0: float, throughput_n: float,
               step_n0: float | None, step_n: float | None) -> float | None:
    """Weak: throughput(N) / (N/N0 x throughput(N0)); strong: T(N0) x N0 / (N x T(N))."""
    if mode == "strong":
        if not step_n or step_n0 is None:
            return None
        return step_n0 * n0 / (n * step_n)
    return throughput_n / (throughput_n0 * n / n0) if throughput_n0 else None


def build_report(path: str | Path, *, topology: Topology | None = None,
                 default_topology: Topology | None = None,
                 with_prediction: bool = True) -> ScalingReport:
    """Read a sweep directory, a run directory, or a directory of runs into a ScalingReport.

    DlaunchError (one line) when the directory holds no run. The topology (link bandwidth,
    prediction) is `topology` if given, else the one the sweep recorded, else
    `default_topology`.
    """
    target = discover(Path(path))
    topo = topology or target.topology or default_topology
    points: list[Point] = []
    first_data: RunData | None = None
    plans: dict[int, dict[str, Any]] = {}
    notes = list(target.notes)
    for entry in target.entries:
        data = read_run(entry.run_dir) if entry.run_dir.exists() else None
        if data is None:
            points.append(Point(name=entry.name, world_size=entry.world_size,
                                repeat=entry.repeat, status=entry.status or "missing",
                                run_dir=str(entry.run_dir), error=entry.error))
            continue
        if first_data is None and data.spec is not None:
            first_data = data
        if data.plan is not None:
            plans.setdefault(entry.world_size, data.plan)
        points.append(build_point(data, name=entry.name, world_size=entry.world_size,
                                  repeat=entry.repeat, topology=topo,
                                  manifest_status=entry.status, manifest_error=entry.error))
    if not any(p.status != "missing" or p.run_id for p in points) and target.kind != "sweep":
        why = next((n for p in points for n in p.unreadable), "")
        raise DlaunchError(f"no readable run in {path}" + (f": {why}" if why else ""))
    mode = target.mode or _infer_mode(points)
    rows, n0 = _rows(points, mode)
    if target.kind == "run":  # one run has nothing to be efficient relative to
        for row in rows:
            row.efficiency = row.ideal_samples_per_s = None
    if with_prediction:
        from launcher.report.predict import predict  # it builds on this module's rows

        nodes = {p.world_size: p.num_nodes for p in points if p.num_nodes}
        note = predict(rows, first_data, topo, mode, n0, plans, nodes=nodes)
    else:
        note = "prediction skipped"

    units = next((p.sample_units for p in points if p.run_id), "samples")
    link_note = None if topo is not None else (
        "link bandwidth unknown: no topology recorded (pass --topology FILE)")
    return ScalingReport(kind=target.kind, source=str(Path(path).absolute()), mode=mode,
                         sample_units=units, baseline_world_size=n0, rows=rows, points=points,
                         prediction_note=note, link_note=link_note, notes=notes)


def _infer_mode(points: Sequence[Point]) -> str:
    """Runs gathered without a manifest: the same global batch everywhere means strong."""
    batches = {p.global_batch for p in points if p.global_batch}
    sizes = {p.world_size for p in points}
    return "strong" if len(batches) == 1 and len(sizes) > 1 else "weak"


__all__ = ["verdict", "breakdown", "efficiency", "build_report", "build_point",
           "ScalingReport", "Point", "Row", "PARTS", "GROUP_LIMIT", "percentile"]

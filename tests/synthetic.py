"""Synthetic run directories in the harness's exact file format, for report tests and the
report benchmark: known step times in, hand-computable numbers out."""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping
from pathlib import Path

from launcher.drivers.sweeppoints import point_name
from launcher.files import atomic_write_json
from launcher.results.aggregate import aggregate, percentile
from launcher.results.types import RankResult, RunResult
from launcher.results.verdict import find_stragglers
from launcher.rundir import RunPaths, SweepPaths
from launcher.runspec import LaunchSpec


def _dump(rec: dict) -> str:
    return json.dumps(rec, separators=(",", ":")) + "\n"


def step_time(base: float, rank: int, step: int, jitter: float) -> float:
    """Deterministic step time with +-jitter/2 relative noise."""
    if not jitter:
        return base
    return base * (1 + jitter * (((rank * 7919 + step * 104729) % 1000) / 1000 - 0.5))


def write_run(run_dir: Path, *, world_size: int, steps: int = 20, warmup: int = 2,
              micro_batch: int = 8, grad_accum: int = 1, step_s: float = 0.1,
              data_wait_s: float = 0.0, exposed_comm_s: float | None = None,
              nosync_step_s: float | None = None, busbw_gb_s: float | None = None,
              nosync_by_rank: Mapping[int, float] | None = None,
              busbw_by_rank: Mapping[int, float] | None = None,
              slow: Mapping[int, float] | None = None, jitter: float = 0.0,
              ranks_per_node: int | None = None, units_per_sample: int = 1,
              sample_units: str = "samples", result: str | None = "aggregate", gap_s: float = 0.0,
              workload: str = "/nonexistent/synthetic_workload.py",
              verdict: object = None, spec: LaunchSpec | None = None) -> Path:
    """Write launch.json, rank-<r>.jsonl and summaries (and result.json: "aggregate" runs the
    real aggregation, "direct" computes it here, fast enough for thousands of ranks).
    Step end times advance by each step time plus `gap_s` (the loop's work between steps).
    `spec`: the run's own LaunchSpec (its launch.json), instead of one made of the numbers."""
    run_dir.mkdir(parents=True, exist_ok=True)
    paths = RunPaths(root=run_dir)
    per_node = ranks_per_node or world_size
    nodes = -(-world_size // per_node)
    spec = spec or LaunchSpec(workload=workload, run_id=run_dir.name, run_dir=str(run_dir),
                              gpus=per_node, nodes=nodes, steps=steps,
                              warmup_steps=warmup, micro_batch=micro_batch, grad_accum=grad_accum)
    atomic_write_json(paths.launch, spec.to_dict())
    samples = micro_batch * grad_accum
    ranks = []
    for r in range(world_size):
        factor = (slow or {}).get(r, 1.0)
        lines = [_dump({"kind": "start", "rank": r, "pid": 1000 + r, "time": 1.0e9,
                        "local_rank": r % per_node, "node_rank": r // per_node,
                        "world_size": world_size, "host": f"node{r // per_node}",
                        "device": "cpu", "strategy": "ddp", "precision": "fp32",
                        "micro_batch": micro_batch, "grad_accum": grad_accum}),
                 _dump({"kind": "workload", "sample_units": sample_units,
                        "units_per_sample": units_per_sample})]
        if exposed_comm_s is not None and world_size > 1:
            nos = (nosync_by_rank or {}).get(r, nosync_step_s if nosync_step_s is not None
                                             else step_s / 2)
            bw = (busbw_by_rank or {}).get(r, busbw_gb_s or 1.0)
            lines.append(_dump({"kind": "comm", "nosync_step_s": nos,
                                "sync_step_s": nos + exposed_comm_s,
                                "exposed_comm_s": exposed_comm_s, "allreduce_bytes": 4_000_000,
                                "allreduce_s": 4e6 / (bw * 1e9 * world_size / (2 * (world_size - 1))),
                                "algbw_gb_s": bw * world_size / (2 * (world_size - 1)),
                                "busbw_gb_s": bw}))
        times = []
        clock = 1.0e9
        for s in range(1, steps + 1):
            t = step_time(step_s, r, s, jitter) * factor
            times.append(t)
            clock += t + gap_s
            # the harness's key order (json.dumps is too slow for millions of records)
            lines.append(f'{{"kind":"step","step":{s},"end_time":{clock!r},'
                         f'"data_wait_s":{data_wait_s!r},"samples":{samples},'
                         f'"units":{samples * units_per_sample},'
                         f'"warmup":{"true" if s <= warmup else "false"},"step_time_s":{t!r},'
                         f'"loss":{2.0 - s / steps!r},"peak_mem_bytes":{1 << 28},'
                         f'"time":{clock!r}}}\n')
        lines.append(_dump({"kind": "end", "time": 1.0e9 + steps + 1, "steps": steps,
                            "status": "ok"}))
        paths.records(r).write_text("".join(lines))
        if result != "direct":  # only aggregation reads summaries; 4,096 files cost seconds
            paths.summary(r).write_text(json.dumps(
                {"rank": r, "status": "ok", "steps": steps, "time": 1.0e9 + steps + 1}))
        ranks.append((r, per_node, times[warmup:]))
    if result == "aggregate":
        res = aggregate(run_dir, exit_code=0, wall_time_s=1.0)
        atomic_write_json(paths.result, {**res.to_dict(), **(
            {"verdict": verdict} if verdict is not None else {})})
    elif result == "direct":
        res = _direct(spec, ranks, samples, units_per_sample, sample_units, data_wait_s,
                      exposed_comm_s, busbw_gb_s)
        atomic_write_json(paths.result, res.to_dict())
    return run_dir


def _direct(spec: LaunchSpec, ranks: list, samples: int, ups: int, units: str, wait: float,
            exposed: float | None, busbw: float | None) -> RunResult:
    out = []
    medians = {}
    for r, per_node, times in ranks:
        total = sum(times)
        xs = sorted(times)
        medians[r] = statistics.median(xs)
        out.append(RankResult(
            rank=r, local_rank=r % per_node, node_rank=r // per_node, host=f"node{r // per_node}",
            status="ok", steps=spec.steps, steady_steps=len(times),
            samples_per_s=samples * len(times) / total, units_per_s=samples * ups * len(times) / total,
            step_time_median_s=medians[r], step_time_p90_s=percentile(xs, 90),
            step_time_max_s=xs[-1], data_wait_share=wait * len(times) / total,
            peak_mem_bytes=1 << 28, final_loss=1.0,
            exposed_comm_s=exposed if spec.world_size > 1 else None,
            busbw_gb_s=(busbw or 1.0) if exposed is not None and spec.world_size > 1 else None))
    strag = find_stragglers(medians)
    out = [RankResult(**{**rr.__dict__, "straggler": rr.rank in strag}) for rr in out]
    return RunResult(
        run_id=spec.run_id, run_dir=spec.run_dir, workload=spec.workload,
        world_size=spec.world_size, num_nodes=spec.nodes, device="cpu", strategy="ddp",
        precision="fp32", status="ok", exit_code=0, wall_time_s=1.0,
        samples_per_s=sum(x.samples_per_s for x in out), units_per_s=sum(x.units_per_s for x in out),
        sample_units=units, step_time_median_s=statistics.median(medians.values()),
        slowest_rank=max(medians, key=medians.get), data_wait_share=statistics.fmean(
            x.data_wait_share for x in out), ranks=tuple(out),
        exposed_comm_s=exposed if spec.world_size > 1 else None,
        busbw_gb_s=(busbw or 1.0) if exposed is not None and spec.world_size > 1 else None,
        stragglers=strag)


def write_sweep(sweep_dir: Path, points: Mapping[int, dict], *, mode: str = "weak",
                topology: Mapping | None = None) -> Path:
    """A sweep directory with a manifest and one synthetic run per world size."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    paths = SweepPaths(root=sweep_dir)
    recs = []
    for n, kw in sorted(points.items()):
        name = point_name(n, 0)
        write_run(paths.point(name).root, world_size=n, **kw)
        mb = kw.get("micro_batch", 8)
        recs.append({"name": name, "world_size": n, "repeat": 0, "micro_batch": mb,
                     "global_batch": mb * n, "status": "ok", "run_id": name})
    atomic_write_json(paths.manifest, {"kind": "sweep", "version": 1, "mode": mode,
                                       "name": sweep_dir.name, "config": {},
                                       "topology": topology, "points": recs})
    return sweep_dir

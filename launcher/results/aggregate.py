"""Read every rank's files into a `RunResult`.

Tolerant by design: a rank file cut mid-line (killed rank) is read up to its last whole
record, a record of the wrong shape or of another run is skipped, a missing rank is reported as
missing, and the reasons are kept in `unreadable` (results.records reads the files). The ranks
are the rank files present, never a count launch.json claims. A run dir read with no
result.json is "running" while its dlaunch lives and "orphaned" once it died without one.

Attempts: a requeued SLURM job appends a second `start` record (and its steps) to the same rank
files; a `--max-restarts` relaunch moves the failed attempt aside but its start record says
which attempt it is. Each rank's numbers come from its records after its LAST start record
only (a requeued 1500-step run must not report 1650 steps); `steps` adds the steps the
checkpoint it resumed from covers, and `RunResult.attempts` says how many attempts there were.

Throughput is wall-clock: global samples over the steady steps / the wall time from the end of
warm-up to the end of the last step (each step record's `end_time`), so what the loop does
between steps counts. Rank files from before `end_time` was recorded fall back to summed step
times. Step-time medians and percentiles always come from the steps' own `step_time_s`.
A rank's `peak_mem_bytes` is its steady steps' peak (on CUDA the rank resets the allocator's
peak at the first steady step: warm-up and compile autotuning are not what the plan predicts).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from launcher.files import read_json
from launcher.results.misfits import find_misfit
from launcher.results.plausibility import host_load, run_warnings
from launcher.results.prediction import compare, measured_peak_bytes
from launcher.results.records import missing_note, owner_state, rank_numbers, read_plan_json, read_ranks, read_spec
from launcher.results.types import RankResult, RunResult
from launcher.results.verdict import detect_stragglers, median_or_none, run_verdict
from launcher.rundir import RunPaths

log = logging.getLogger(__name__)

LOG_TAIL_LINES = 12


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of a non-empty sequence."""
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def rank_log_tail(run_dir: Path, node_rank: int, local_rank: int, *, lines: int = LOG_TAIL_LINES) -> tuple[str, ...]:
    """The last lines of the rank's stderr log (torchrun's per-rank files), newest attempt."""
    found = RunPaths(root=run_dir).rank_logs(node_rank, local_rank, "stderr")
    return tuple(found[-1].read_text(encoding="utf-8", errors="replace").splitlines()[-lines:]) if found else ()


def _script_status(run_dir: Path, rank: int, exit_code: int | None) -> str:
    """A plain script without the step meter leaves no summary: judge by exit code and log."""
    if exit_code == 0:
        return "ok"
    tail = rank_log_tail(run_dir, 0, rank)
    return "failed" if any("Error" in line or "Traceback" in line for line in tail) else "stopped"


def last_attempt(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """The records from the last `start` record on, and how many attempts the file shows: the larger
    of its start records and the last start's `attempt` + 1 (see the module docstring)."""
    starts = [i for i, r in enumerate(records) if r.get("kind") == "start"]
    if not starts:
        return records, 1
    attempt = records[starts[-1]].get("attempt") or 0
    return records[starts[-1]:], max(len(starts), int(attempt) + 1)


def node_ids(run_dir: Path) -> dict[str, int]:
    """host -> SLURM node id, from the node.json each SLURM node task wrote ({} for a run on this host)."""
    out: dict[str, int] = {}
    for path in RunPaths(root=run_dir).node_records():
        try:
            data = read_json(path)
            out[str(data["host"])] = int(data["slurm_node_id"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def _rank_result(run_dir: Path, rank: int, records: list[dict[str, Any]], summary: dict[str, Any] | None, *,
                 script_exit: int | None = None, is_script: bool = False, earlier_loss: float | None = None,
                 nodes: dict[str, int] | None = None) -> RankResult:
    """One rank from its last attempt's records; `earlier_loss`: the last loss any earlier
    attempt recorded (the final loss of an attempt that resumed at the last step); `nodes`:
    host -> SLURM node id (`node_ids`). torchrun's c10d rendezvous numbers the nodes (what a
    rank records as its node_rank) by sorted host name and pid, not in SLURM_NODEID order, while
    each node's log dir is named after SLURM_NODEID: where a node.json names the rank's host, its
    node is SLURM's, so the rank's failure line and log tail are its own node's."""
    start = next((r for r in records if r.get("kind") == "start"), {})
    steps = [r for r in records if r.get("kind") == "step"]
    resumed = next((int(r["step"]) for r in records if r.get("kind") == "resume"), None)
    # profiled steps (--profile) run slower: out of throughput like warm-up. A run that ended in warm-up is
    # measured on its warm-up steps but the first (timed from the start: imports, rendezvous, compile)
    steady = [r for r in steps if not r.get("warmup") and not r.get("profiled")] or steps[1:] or steps
    wall = measured_wall_s(steps, steady)
    total_time = wall if wall is not None else sum(r["step_time_s"] for r in steady)
    times = [r["step_time_s"] for r in steady] or [0.0]
    status = (summary["status"] if summary
              else _script_status(run_dir, rank, script_exit) if is_script
              else "incomplete" if records else "missing")
    host = str(start.get("host", "?"))
    node_rank = (nodes or {}).get(host, int(start.get("node_rank", 0)))
    local_rank = int(start.get("local_rank", rank))
    # the steady steps' peak (see the module docstring); on CPU the resident peak only ever grows
    peaks = [r["peak_mem_bytes"] for r in steady if r.get("peak_mem_bytes") is not None] or [
        r["peak_mem_bytes"] for r in steps if r.get("peak_mem_bytes") is not None]
    live = max(((int(r["live_peak_bytes"]), int(r["step"])) for r in steps
                if r.get("live_peak_bytes") is not None), default=None)
    step_sum = sum(r["step_time_s"] for r in steady)
    comm = next((r for r in records if r.get("kind") == "comm"), {})
    comp = next((r for r in records if r.get("kind") == "compile"), {})
    prof = next((r for r in records if r.get("kind") == "profile"), {})
    prof_time = sum(r["step_time_s"] for r in steps if r.get("profiled"))
    return RankResult(
        rank=rank, local_rank=local_rank, node_rank=node_rank, host=host, status=status,
        # a killed rank's summary (written by dlaunch) has its heartbeat's step: past its last flush (a
        # summary older than this attempt's start, a requeued job's, does not count)
        steps=max((resumed or 0) + len(steps), int((summary or {}).get("steps", 0)) if summary and float(
            summary.get("time", 0.0)) >= float(start.get("time", 0.0)) else 0), steady_steps=len(steady),
        samples_per_s=sum(r["samples"] for r in steady) / total_time if total_time else 0.0,
        units_per_s=sum(r["units"] for r in steady) / total_time if total_time else 0.0,
        step_time_median_s=statistics.median(times), step_time_p90_s=percentile(times, 90), step_time_max_s=max(times),
        data_wait_share=(sum(r["data_wait_s"] for r in steady) / step_sum) if step_sum else 0.0,
        peak_mem_bytes=max(peaks) if peaks else None, final_loss=steps[-1].get("loss") if steps else earlier_loss,
        error=summary.get("error") if summary else None,
        log_tail=rank_log_tail(run_dir, node_rank, local_rank) if status != "ok" else (),
        exposed_comm_s=comm.get("exposed_comm_s"), busbw_gb_s=comm.get("busbw_gb_s"), tp_comm_s=comm.get("tp_comm_s"),
        skipped_steps=sum(1 for r in steps if r.get("skipped")),
        # a rank writes a NaN or infinite loss as null (strict JSON), and only those
        nonfinite_loss_step=next((int(r["step"]) for r in steps if "loss" in r and r["loss"] is None), None),
        compiled_graphs=comp.get("graphs"), graph_breaks=comp.get("graph_breaks"),
        recompiles=comp.get("recompiles"), compile_fallback=comp.get("fallback"),
        profile_trace=prof.get("trace"), top_ops=tuple(prof.get("top_ops", ())),
        device_busy_share=(min(1.0, prof["device_time_s"] / prof_time)
                           if prof.get("device_time_s") is not None and prof_time else None),
        resumed_from_step=resumed, measured_wall_s=wall, step_time_mean_s=step_sum / len(steady) if steady else None,
        live_peak_bytes=live[0] if live else None, live_peak_step=live[1] if live else None,
        last_eval=summary.get("eval") if summary else None)


def measured_wall_s(steps: Sequence[dict[str, Any]], steady: Sequence[dict[str, Any]]) -> float | None:
    """Wall seconds the steady steps took, what the loop did between steps included: each spans
    from the end of the step before it (`end_time`; the attempt's first step: its own
    `step_time_s`) to its own end, so steps left out in between (profiled ones) drop out with
    their spans. None when a step has no `end_time` (rank files from before it was recorded)."""
    if not steady or any("end_time" not in r for r in steps):
        return None
    counted = {id(r) for r in steady}
    total = 0.0
    for i, r in enumerate(steps):
        if id(r) in counted:
            start = float(steps[i - 1]["end_time"]) if i else float(r["end_time"]) - float(r["step_time_s"])
            total += float(r["end_time"]) - start
    return total if total > 0 else None


def _launcher_warnings(rd: Path) -> tuple[str, ...]:
    """What the launcher warned of while the ranks ran (kept in the run dir so that reading it
    again gives the same result); () when it warned of nothing or the file is unreadable."""
    path = RunPaths(root=rd).launcher_warnings
    if not path.exists():
        return ()
    try:
        said: Any = read_json(path)
    except (OSError, ValueError) as e:
        log.warning("%s unreadable (%s); its warnings left out", path, e)
        return ()
    return tuple(str(w) for w in said) if isinstance(said, list) else ()


def aggregate(run_dir: str | Path, *, exit_code: int | None = None, wall_time_s: float | None = None) -> RunResult:
    """Aggregate a run directory (written by `dlaunch run`) into a RunResult."""
    rd = Path(run_dir)
    spec = read_spec(rd)
    present, missing, unlisted = rank_numbers(rd, spec.world_size)
    listed = sorted(present + missing)
    every, summaries, notes = read_ranks(rd, present, spec.run_id)
    split = {r: last_attempt(recs) for r, recs in every.items()}
    records = {r: recs for r, (recs, _) in split.items()}
    attempts = max((n for _, n in split.values()), default=1)
    nodes = node_ids(rd)
    ranks = tuple(_rank_result(rd, r, records.get(r, []), summaries.get(r),
                               script_exit=exit_code, is_script=spec.is_script,
                               earlier_loss=_last_loss(every.get(r, [])), nodes=nodes)
                  for r in listed)
    units = next((rec.get("sample_units") for recs in records.values() for rec in recs
                  if rec.get("kind") == "workload"), "samples")
    # plain scripts report their units in the start record of the step meter
    units = next((rec.get("sample_units") for recs in records.values() for rec in recs
                  if rec.get("kind") == "start" and rec.get("sample_units")), units)
    busy = {rank: float(rec["nosync_step_s"]) for rank, recs in records.items() for rec in recs
            if rec.get("kind") == "comm" and rec.get("nosync_step_s") is not None}
    slow = detect_stragglers({r.rank: r.step_time_median_s for r in ranks if r.steady_steps}, busy)
    stragglers = tuple(s.rank for s in slow)
    ranks = tuple(dataclasses.replace(r, straggler=r.rank in stragglers) for r in ranks)
    measured = [r for r in ranks if r.steady_steps]
    samples_per_s, units_per_s, basis = _throughput(ranks, measured)
    step_median = statistics.median([r.step_time_median_s for r in measured]) if measured else 0.0
    plan, unusable = read_plan_json(rd)
    if unusable:
        notes.append(unusable)
    prediction = (compare(plan, spec, step_time_s=step_median if measured else None,
                          peak_mem_bytes=measured_peak_bytes(ranks, spec.device), device=spec.device)
                  if unusable is None else {"available": False, "reason": unusable})
    slowest = max(measured, key=lambda r: r.step_time_median_s).rank if measured else None
    # read after the fact with no result: the launcher still runs, or died before writing it
    owner = owner_state(rd) if exit_code is None and not RunPaths(root=rd).result.exists() else None
    if owner == "running":
        # a rank without its summary is still training, not failed: a live report says so
        ranks = tuple(dataclasses.replace(r, status="running") if r.status == "incomplete" else r for r in ranks)
    failures = _failures(ranks, summaries)
    if (unlisted_line := missing_note(spec.world_size, len(present), unlisted)) is not None:
        failures += (unlisted_line,)
    all_ok = all(r.status == "ok" for r in ranks) and unlisted <= 0
    code = exit_code if exit_code is not None else (0 if all_ok else 1)
    status = owner or ("ok" if code == 0 and all_ok else "failed")
    if spec.is_script and not measured and status == "ok":  # a run stopped early says why itself
        notes.append("the script reported no steps: no torch optimizer stepped and no StepMeter was called "
                     "(launcher.runtime.meter.StepMeter.step() once per step shows its throughput)")
    if code != 0 and all_ok:
        failures = failures + (f"torchrun exited {code} although every rank reported success",)
    hosts = host_load(every)
    return RunResult(
        run_id=spec.run_id, run_dir=str(rd), workload=spec.workload, world_size=spec.world_size,
        num_nodes=spec.nodes, device=spec.device, strategy="script" if spec.is_script else spec.strategy,
        precision=spec.precision, status=status, exit_code=code,
        wall_time_s=wall_time_s if wall_time_s is not None else _wall_time(every),
        samples_per_s=samples_per_s, units_per_s=units_per_s, sample_units=str(units),
        step_time_median_s=step_median, slowest_rank=slowest,
        data_wait_share=statistics.fmean([r.data_wait_share for r in measured]) if measured else 0.0,
        ranks=ranks, failures=failures, unreadable=tuple(notes),
        exposed_comm_s=median_or_none([r.exposed_comm_s for r in ranks]),
        tp_comm_s=median_or_none([r.tp_comm_s for r in ranks]),
        busbw_gb_s=median_or_none([r.busbw_gb_s for r in ranks]),
        stragglers=stragglers, straggler_evidence=tuple(s.to_dict() for s in slow),
        verdict=run_verdict(ranks, measured, nosync_s=busy, accum=spec.grad_accum,
                            script=spec.is_script, world_size=spec.world_size),
        attempts=attempts, throughput_basis=basis, prediction=prediction,
        host_load=hosts, warnings=(*run_warnings(ranks, hosts, prediction), *_launcher_warnings(rd)),
        last_eval=next((r.last_eval for r in ranks if r.last_eval), None),
        offload=bool(spec.offload), float8=spec.float8 or "none", reduce_dtype=spec.reduce_dtype or "fp32",
        fsdp_unit=spec.fsdp_unit or "block")


def _throughput(ranks: Sequence[RankResult], measured: Sequence[RankResult]) -> tuple[float, float, str]:
    """(samples/s, units/s, basis) of the whole run (see the module docstring): on the wall
    clock, the global samples (units) over the longest rank's wall time, each rank's on its own
    clock (hosts' clocks are never compared)."""
    walls = [r.measured_wall_s for r in measured]
    if not measured or any(w is None for w in walls):
        return sum(r.samples_per_s for r in ranks), sum(r.units_per_s for r in ranks), "step time"
    wall = max(w for w in walls if w is not None)
    # a rank's rate times its own wall gives back its samples exactly
    samples = sum(r.samples_per_s * (r.measured_wall_s or 0.0) for r in measured)
    units = sum(r.units_per_s * (r.measured_wall_s or 0.0) for r in measured)
    return samples / wall, units / wall, "wall clock"


def _failures(ranks: tuple[RankResult, ...], summaries: dict[int, dict[str, Any]]) -> tuple[str, ...]:
    """One line per failed rank, the earliest failure (the likely cause) first."""
    out = []
    told: set[str] = set()  # a misfit's fix is said once, on the first rank that shows it
    for r in sorted((r for r in ranks if r.status not in ("ok", "running")),
                    key=lambda r: summaries.get(r.rank, {}).get("time", float("inf"))):
        summary = summaries.get(r.rank, {})
        if r.status == "preempted":
            # not an error: the rank saved and left on purpose (runtime.resume)
            what = (f"stopped on {summary.get('preempted_by', 'a preemption signal')} after saving "
                    f"the checkpoint of step {summary.get('checkpoint_step', r.steps)}")
        else:
            what = r.error or (r.log_tail[-1] if r.log_tail else f"no summary ({r.status})")
            misfit = find_misfit([r.error, summary.get("rank_error"), *r.log_tail])
            if misfit is not None and misfit.name not in told:
                told.add(misfit.name)
                what += f"; what to change: {misfit.fix}"
        host = "unknown" if r.host == "?" else r.host  # no start record: it never got that far
        out.append(f"rank {r.rank} (host {host}, node {r.node_rank}, local rank {r.local_rank}) "
                   f"{r.status} after {r.steps} steps: {what}")
    return tuple(out)


def _last_loss(records: list[dict[str, Any]]) -> float | None:
    return next((r["loss"] for r in reversed(records) if r.get("kind") == "step" and r.get("loss") is not None), None)


def _wall_time(records: dict[int, list[dict[str, Any]]]) -> float:
    times = [rec["time"] for recs in records.values() for rec in recs if "time" in rec]
    return (max(times) - min(times)) if times else 0.0

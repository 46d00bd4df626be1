"""Plain-text tables for the terminal."""

from __future__ import annotations

from collections.abc import Sequence

from launcher.results.prediction import prediction_line
from launcher.results.types import RunResult
from launcher.rundir import RunPaths
from launcher.specs import GIB

SKIP_WARN_FRACTION = 0.01


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]], *, right: bool = True) -> str:
    """Left-aligned first column, right-aligned others (`right`; else all left-aligned), two spaces apart."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    return "\n".join("  ".join(str(c).rjust(w) if right and i else str(c).ljust(w)
                               for i, (c, w) in enumerate(zip(row, widths))).rstrip() for row in (header, *rows))


def _mem(b: int | None) -> str:
    return "-" if b is None else f"{b / GIB:.2f} GiB"


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}" if x >= 100 else f"{x:,.1f}"


def _secs(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}s"


def _share(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def no_steps(result: RunResult) -> bool:
    """The run (or every rank of it) recorded no training step."""
    return not any(r.steps for r in result.ranks)


def status_text(result: RunResult) -> str:
    """The run's status as people read it: "ok, no steps reported" for a run that exited 0
    without recording a step (a script that gave up before training), "ok, loss NaN from step
    N" for one whose loss went NaN or infinite (it trained to the end, on garbage)."""
    if result.status != "ok":
        return result.status
    if no_steps(result):
        return "ok, no steps reported"
    bad = [r.nonfinite_loss_step for r in result.ranks if r.nonfinite_loss_step is not None]
    return f"ok, loss NaN from step {min(bad)}" if bad else "ok"


def format_run(result: RunResult) -> str:
    """The summary printed at the end of `dlaunch run`. What was not measured shows as "-", never
    as 0: a rank without steady steps has no rate or step time, and a plain script's data wait
    when nothing measured it."""
    units = result.sample_units
    cpu = result.device == "cpu"
    # a plain script's data wait is measured when its DataLoader was (launcher.runtime.bootstrap)
    # or its own meter said it; all zero is nobody measuring it
    script = result.strategy == "script" and not result.data_wait_share
    head = (f"run {result.run_id}: {result.world_size} rank(s) on {result.num_nodes} node(s), "
            f"{result.device}, {result.strategy}{' + CPU offload' if result.offload else ''}"
            f"{' + linear-layer units' if result.fsdp_unit == 'linear' else ''} {result.precision}"
            f"{f' + float8 ({result.float8})' if result.float8 != 'none' else ''}"
            f"{' + bf16 gradient reduce' if result.reduce_dtype == 'bf16' else ''}: "
            f"{status_text(result).upper()} "
            f"(exit {result.exit_code}, wall {result.wall_time_s:.1f} s)")
    per_unit = units != "samples"
    header = ["rank", "host", "status", "steps", "samples/s", *([f"{units}/s"] if per_unit else []),
              "step med", "p90", "max", "data wait", *(["tensors peak", "RSS peak"] if cpu else ["peak alloc"]), "loss"]
    rows = []
    for r in result.ranks:
        ran = r.steady_steps > 0
        rows.append([str(r.rank), f"{'-' if r.host == '?' else r.host}/{r.local_rank}",
                     "ok, no steps" if r.status == "ok" and not r.steps else r.status, str(r.steps),
                     _rate(r.samples_per_s if ran else None),
                     *([_rate(r.units_per_s if ran else None)] if per_unit else []),
                     _secs(r.step_time_median_s if ran else None), _secs(r.step_time_p90_s if ran else None),
                     _secs(r.step_time_max_s if ran else None),
                     _share(r.data_wait_share if ran and not script else None),
                     *([_mem(r.live_peak_bytes)] if cpu else []), _mem(r.peak_mem_bytes),
                     "-" if r.final_loss is None else f"{r.final_loss:.4f}"])
    ran = result.slowest_rank is not None
    rows.append(["all", "", status_text(result), "", _rate(result.samples_per_s if ran else None),
                 *([_rate(result.units_per_s if ran else None)] if per_unit else []),
                 _secs(result.step_time_median_s if ran else None), "", "",
                 _share(result.data_wait_share if ran and not script else None), *([""] * (3 if cpu else 2))])
    out = [head, format_table(header, rows), *memory_lines(result)]
    if result.slowest_rank is not None and len(result.ranks) > 1:
        slow = result.ranks[result.slowest_rank]
        out.append(f"slowest rank: {slow.rank} on {slow.host} (median step {slow.step_time_median_s:.3f} s)")
    if result.exposed_comm_s is not None:
        share = result.exposed_comm_s / result.step_time_median_s if result.step_time_median_s else 0.0
        bw = f", all-reduce busbw {result.busbw_gb_s:.2f} GB/s" if result.busbw_gb_s is not None else ""
        dp = " by data parallelism (sync-off calibration)" if result.tp_comm_s is not None else ""
        out.append(f"communication: {1000 * result.exposed_comm_s:.1f} ms exposed per step{dp} "
                   f"({100 * share:.0f}% of the median step){bw}")
    if result.tp_comm_s is not None:
        share = result.tp_comm_s / result.step_time_median_s if result.step_time_median_s else 0.0
        out.append(f"communication: {1000 * result.tp_comm_s:.1f} ms per step in tensor parallelism's "
                   f"collectives ({100 * share:.0f}% of the median step; timed in one pass, none overlapped)")
    out += [*compile_lines(result), *profile_lines(result)]
    if result.verdict:
        out.append(f"verdict: {result.verdict['name']}: {result.verdict.get('evidence', '')}")
    out += [prediction_line(result.prediction), *(f"WARNING: {w}" for w in result.warnings)]
    # a GradScaler that keeps skipping steps is the classic silently plateauing loss
    out += [f"WARNING: rank {r.rank} skipped {r.skipped_steps} of {r.steps} optimizer steps (fp16 overflow); "
            "the loss may plateau: check the loss scale or use bf16"
            for r in result.ranks if r.steps and r.skipped_steps / r.steps > SKIP_WARN_FRACTION]
    out += [*eval_lines(result), *straggler_lines(result)]
    if result.attempts > 1:
        resumed = sorted({r.resumed_from_step for r in result.ranks if r.resumed_from_step})
        how = (f"resumed from the checkpoint of step {resumed[0]}" if len(resumed) == 1 else
               "started over (no checkpoint)" if not resumed else f"resumed from steps {', '.join(map(str, resumed))}")
        out.append(f"attempts: {result.attempts}; the last {how}; the table shows the last attempt "
                   "(steps include those its checkpoint covers)")
    out += [f"FAILED: {f}" for f in result.failures]
    for r in result.ranks:
        if r.status != "ok" and r.log_tail:
            out.append(f"last lines of rank {r.rank}'s stderr:")
            out.extend(f"  | {line}" for line in r.log_tail[-6:])
    out += [f"note: {note}" for note in result.unreadable]
    if not any(f.startswith("result.json not written") for f in result.failures):
        out.append(f"result: {RunPaths(root=result.run_dir).result}")
    return "\n".join(out)


def memory_lines(result: RunResult) -> list[str]:
    """The largest rank's memory: what was measured, labelled, beside the plan's estimate."""
    est = result.prediction or {}
    plan = (f"; the plan estimated {est['mem_gib']:.2f} GiB per rank"
            if est.get("available") and est.get("mem_gib") is not None else "")
    peaks = [r.peak_mem_bytes for r in result.ranks if r.peak_mem_bytes is not None]
    peak = _mem(max(peaks)) if peaks else "not measured"
    if result.device != "cpu":
        return [f"memory (largest rank): {peak} allocated by torch at peak{plan}"] if peaks or plan else []
    live = [r for r in result.ranks if r.live_peak_bytes is not None]
    top = max(live, key=lambda r: r.live_peak_bytes or 0) if live else None
    tensors = (f"{_mem(top.live_peak_bytes)} live tensors at peak (step {top.live_peak_step}, "
               "parameters + optimizer state + what the step made)" if top is not None
               else "live tensor bytes not measured")
    if not peaks and top is None and not plan:
        return []
    return [f"memory (largest rank): {tensors}; process RSS {peak} (includes the Python and torch runtime){plan}"]


def eval_lines(result: RunResult) -> list[str]:
    """The workload's last `evaluate` (--eval-every), one line; none without one."""
    if not result.last_eval:
        return []
    metrics = dict(result.last_eval)
    step = metrics.pop("step", "?")
    shown = ", ".join(f"{k} {v:.4g}" if isinstance(v, (int, float)) else f"{k} {v}" for k, v in metrics.items())
    return [f"evaluation at step {step}: {shown}"]


def straggler_lines(result: RunResult) -> list[str]:
    """One line per straggler with the numbers of the rule that flagged it."""
    evidence = {int(e["rank"]): e for e in result.straggler_evidence}
    out = []
    for rank in result.stragglers:
        r = result.ranks[rank]
        where = f"STRAGGLER: rank {r.rank} on {r.host} (local rank {r.local_rank})"
        if rank in evidence:
            out.append(f"{where}, by {evidence[rank]['rule']}: {evidence[rank]['evidence']}")
        else:  # a result.json written before the evidence was kept: say so, guess no rule
            out.append(f"{where}: the rule that flagged it was not recorded; median step "
                       f"{r.step_time_median_s:.3f} s vs {result.step_time_median_s:.3f} s median of medians")
    return out


def compile_lines(result: RunResult) -> list[str]:
    """torch.compile: graphs, graph breaks, recompilations (rank 0's), and any eager fallback."""
    ranks = [r for r in result.ranks if r.compiled_graphs is not None]
    if not ranks:
        return []
    r0 = ranks[0]
    out = [f"compile: {r0.compiled_graphs} graph(s), {r0.graph_breaks} graph break(s), "
           f"{r0.recompiles} recompilation(s) on rank {r0.rank}"]
    if fell := [r for r in ranks if r.compile_fallback]:
        out.append(f"WARNING: torch.compile failed on rank(s) {', '.join(str(r.rank) for r in fell)}; "
                   f"they ran eagerly: {fell[0].compile_fallback}")
    return out


def profile_lines(result: RunResult, *, top: int = 5) -> list[str]:
    """--profile: where the traces are and rank 0's top operators by self time."""
    traced = [r for r in result.ranks if r.profile_trace]
    if not traced:
        return []
    r0 = traced[0]
    by = "self CUDA time" if result.device == "cuda" else "self CPU time"
    out = [f"profile: {len(traced)} trace(s) in {result.run_dir} (trace-rank<r>.json; open in "
           f"https://ui.perfetto.dev); rank {r0.rank}'s top operators by {by}:"]
    rows = [[op["name"][:60], f"{op['per_step_ms']:.2f} ms/step", f"{100 * op['share']:.1f}%",
             f"{op.get('calls_per_step', op['calls']):g}"] for op in r0.top_ops[:top]]
    if rows:
        out.extend("  " + line for line in format_table(["operator", "self time", "share", "calls/step"],
                                                          rows).splitlines())
    if r0.device_busy_share is not None:
        out.append(f"  GPU busy {100 * r0.device_busy_share:.0f}% of the profiled steps")
    return out

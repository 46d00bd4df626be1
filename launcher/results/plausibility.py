"""Numbers that look wrong: the warnings a run summary and a report print beside the results.

A measurement can be exact and still mislead: a contended host (load above its cores, CPU
steal) slows one point of a sweep and makes the next look superlinear; a few slow steps make a
median unrepresentative; a prediction off by more than 2x says the model or the run is off.
Each rule returns one line that names its numbers and its threshold, never a silent pass.

The host figures come from each rank's start and end records (`host_load`, written by
runtime.recorder): one entry per host, from the first rank on it.

Pure (no torch, no I/O). Never imports report, jobs, backends, cli or runtime.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from launcher.results.types import RankResult

SUPERLINEAR_EFFICIENCY = 1.05  # scaling efficiency above this is not believable as such
# predicted, a larger size can earn more: a larger micro-batch, or no CPU offload, fits there; twice
# linear cannot come from either, only from plans priced on different inputs (a probe on a busy host)
SUPERLINEAR_PREDICTED = 2.0
NOISY_P90_OVER_MEDIAN = 1.5
PREDICTION_MISS_FACTOR = 2.0
STEAL_SHARE = 0.05  # CPU time a hypervisor gave to other guests


def host_load(records: Mapping[int, Sequence[Mapping[str, Any]]]) -> tuple[dict[str, Any], ...]:
    """Per host: load average at start and end, usable cores and the steal share over the run
    (the /proc/stat counters' difference between the start and end records), from the first
    rank on each host whose records carry them."""
    out: dict[str, dict[str, Any]] = {}
    for rank, recs in sorted(records.items()):
        start = next((r for r in recs if r.get("kind") == "start"), None)
        if start is None or not start.get("host_load"):
            continue
        host = str(start.get("host", "?"))
        if host in out:
            continue
        end: Mapping[str, Any] = next((r for r in reversed(recs) if r.get("kind") == "end"), {})
        a, b = start["host_load"], end.get("host_load") or {}
        total = (b.get("total_ticks") or 0) - (a.get("total_ticks") or 0)
        steal = ((b.get("steal_ticks") or 0) - (a.get("steal_ticks") or 0)) / total if (
            total > 0 and "steal_ticks" in a and "steal_ticks" in b) else None
        out[host] = {"host": host, "rank": rank, "usable_cores": a.get("usable_cores"),
                     "load_1m_start": a.get("load_1m"), "load_1m_end": b.get("load_1m"), "steal_share": steal}
    return tuple(out.values())


def busy_host_warnings(hosts: Sequence[Mapping[str, Any]]) -> list[str]:
    """A host whose load average exceeded its usable cores, or whose CPUs were stolen > 5%."""
    out = []
    for h in hosts:
        cores = h.get("usable_cores")
        loads = [x for x in (h.get("load_1m_start"), h.get("load_1m_end")) if x is not None]
        if cores and loads and max(loads) > cores:
            out.append(f"busy host {h['host']}: load average {max(loads):.1f} > {cores} usable core(s) (start "
                       f"{_opt(h.get('load_1m_start'))}, end {_opt(h.get('load_1m_end'))}): step times include "
                       "waiting for a CPU; rerun on an idle host or with fewer threads (OMP_NUM_THREADS)")
        if (steal := h.get("steal_share")) is not None and steal > STEAL_SHARE:
            out.append(f"busy host {h['host']}: CPU steal {steal:.0%} of the run (> "
                       f"{STEAL_SHARE:.0%}): the hypervisor gave its CPUs to other guests")
    return out


def noisy_step_warnings(ranks: Sequence[RankResult]) -> list[str]:
    """Ranks whose p90 step exceeds 1.5x their median step (the worst one named)."""
    noisy = [r for r in ranks if r.steady_steps >= 2 and r.step_time_median_s > 0
             and r.step_time_p90_s / r.step_time_median_s > NOISY_P90_OVER_MEDIAN]
    if not noisy:
        return []
    worst = max(noisy, key=lambda r: r.step_time_p90_s / r.step_time_median_s)
    return [f"noisy steps on rank(s) {', '.join(str(r.rank) for r in noisy)}: p90 step "
            f"{worst.step_time_p90_s:.3f} s is {worst.step_time_p90_s / worst.step_time_median_s:.1f}x "
            f"the median {worst.step_time_median_s:.3f} s on rank {worst.rank} (> "
            f"{NOISY_P90_OVER_MEDIAN:g}x): the median may not represent the run"]


def prediction_warnings(block: Mapping[str, Any] | None) -> list[str]:
    """A measured/predicted ratio beyond 2x either way (step time or memory)."""
    if not block or not block.get("available"):
        return []
    return [f"prediction missed: measured {what} is {ratio:.2f}x the plan's (beyond {PREDICTION_MISS_FACTOR:g}x "
            "either way): the plan's inputs (topology, profile) or the run are off"
            for key, what in (("step_time_ratio", "step time"), ("mem_ratio", "memory"))
            if (ratio := block.get(key)) and (ratio > PREDICTION_MISS_FACTOR or ratio < 1 / PREDICTION_MISS_FACTOR)]


def superlinear_warning(world_size: int, efficiency: float | None, baseline: int, *,
                        predicted: bool = False) -> str | None:
    """Scaling efficiency above 105% (predicted: 200%): more than linear speed-up is almost always
    a slow baseline (a contended host, oversubscribed threads, a plan priced on a busy host's
    probe), not a real effect."""
    limit = SUPERLINEAR_PREDICTED if predicted else SUPERLINEAR_EFFICIENCY
    if efficiency is None or efficiency <= limit:
        return None
    return (f"{'predicted ' if predicted else ''}superlinear scaling: {world_size} rank(s) at {efficiency:.0%} "
            f"efficiency relative to {baseline} rank(s) (> {limit:.0%}); suspect the baseline (a busy "
            f"host, too many threads per rank{', its plan' if predicted else ''}) before believing it")


def nonfinite_loss_warnings(ranks: Sequence[RankResult]) -> list[str]:
    """The first step whose loss was NaN or infinite, and on which ranks."""
    bad = sorted((r.nonfinite_loss_step, r.rank) for r in ranks if r.nonfinite_loss_step is not None)
    if not bad:
        return []
    return [f"the loss was NaN or infinite at step {bad[0][0]} (rank(s) "
            f"{', '.join(str(rank) for _, rank in bad)}); --detect-anomaly finds the op that "
            "makes it, --stop-on-nan ends a run at the first one"]


def run_warnings(ranks: Sequence[RankResult], hosts: Sequence[Mapping[str, Any]],
                 prediction: Mapping[str, Any] | None) -> tuple[str, ...]:
    """Every warning one run earns: a NaN loss, noisy steps, a missed prediction, a busy host."""
    return (*nonfinite_loss_warnings(ranks), *noisy_step_warnings(ranks), *prediction_warnings(prediction),
            *busy_host_warnings(hosts))


def _opt(x: float | None) -> str:
    return "?" if x is None else f"{x:.1f}"

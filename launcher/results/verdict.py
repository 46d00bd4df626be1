"""The rules that judge a measured run: its bottleneck verdict and its straggler ranks.

One place for both: `results.aggregate` applies them when it writes `result.json`, and the
report applies the same functions to what it reads. Every straggler carries the numbers that
triggered it, so what is printed is always the evidence of the rule that fired.

Pure (no torch, no I/O). Never imports report, jobs, backends, cli or runtime.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from launcher.results.types import RankResult

log = logging.getLogger(__name__)

DATA_BOUND_SHARE = 0.20  # batch wait above this share of the step: data-loading bound
COMM_BOUND_SHARE = 0.25  # exposed communication above this share: communication bound
# CUDA only (--profile): a GPU busy less than this share of the step, with neither batches
# nor communication to blame, waits for the CPU to launch kernels
LAUNCH_BOUND_BUSY = 0.70

# a rank is a straggler when its time exceeds the median over ranks by more than this share
STRAGGLER_THRESHOLD = 0.10
# ... and by this much: sub-millisecond steps jitter by more than 10% (and the calibration has only
# a few samples)
STRAGGLER_FLOOR_S = 1e-3
# Under synchronous data parallelism every step ends in the same collective, so a rank slow in
# its own compute has a step time about the others' (a little less: its work between steps hides
# in their wait for it). A step-time median clearly below the median of medians, by a share of the
# step and by a share of the rank's sync-off excess, contradicts the calibration (a few samples,
# taken before training) with the whole run's steady steps, and the steady steps win: no flag.
LOCKSTEP_TOLERANCE = 0.02
LOCKSTEP_SHARE = 0.25

# a verdict that cannot be given: what was not measured is named in its evidence
NOT_MEASURED = "not measured"
NOT_MEASURED_COMM = "compute bound, communication not measured"

STEP_RULE = "step time"
BUSY_RULE = "own compute"


@dataclass(frozen=True, kw_only=True)
class Straggler:
    """A rank flagged slow, by which rule, and the numbers that fired it."""

    rank: int
    rule: str  # STEP_RULE | BUSY_RULE
    rank_s: float  # the rank's time under the rule
    median_s: float  # the median over ranks it was compared with
    step_median_s: float | None = None  # the rank's median step (context for the own-compute rule)
    step_median_of_medians_s: float | None = None

    def __post_init__(self) -> None:
        if self.rule not in (STEP_RULE, BUSY_RULE):
            raise ValueError(f"unknown straggler rule {self.rule!r}")

    @property
    def excess(self) -> float:
        """How much slower than the median, as a share of it."""
        return self.rank_s / self.median_s - 1 if self.median_s > 0 else 0.0

    def evidence(self) -> str:
        """The triggering numbers in one phrase."""
        if self.rule == STEP_RULE:
            return (f"median step {self.rank_s:.3f} s vs {self.median_s:.3f} s median of rank "
                    f"medians (+{self.excess:.0%}; the flag needs > +{STRAGGLER_THRESHOLD:.0%} and "
                    f"> +{1000 * STRAGGLER_FLOOR_S:.0f} ms)")
        out = (f"own forward+backward with gradient sync off {1000 * self.rank_s:.1f} ms vs "
               f"{1000 * self.median_s:.1f} ms median over ranks (+{self.excess:.0%}; the flag needs "
               f"> +{STRAGGLER_THRESHOLD:.0%} and > +{1000 * STRAGGLER_FLOOR_S:.0f} ms; sync-off calibration)")
        if self.step_median_s is not None and self.step_median_of_medians_s is not None:
            out += (f"; its median step {self.step_median_s:.3f} s vs {self.step_median_of_medians_s:.3f} s "
                    "(the all-reduce makes the others wait for it)")
        return out

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict, the evidence phrase included."""
        return {"rank": self.rank, "rule": self.rule, "rank_s": self.rank_s, "median_s": self.median_s,
                "step_median_s": self.step_median_s,
                "step_median_of_medians_s": self.step_median_of_medians_s, "evidence": self.evidence()}


def find_stragglers(medians: Mapping[int, float], threshold: float = STRAGGLER_THRESHOLD) -> tuple[int, ...]:
    """Ranks whose median step time exceeds the median of medians by more than `threshold`."""
    if len(medians) < 2:
        return ()
    mid = statistics.median(medians.values())
    return tuple(sorted(r for r, m in medians.items()
                        if mid > 0 and m > mid * (1 + threshold) and m - mid > STRAGGLER_FLOOR_S))


def detect_stragglers(step_medians: Mapping[int, float],
                      busy: Mapping[int, float] | None = None) -> tuple[Straggler, ...]:
    """Slow ranks by two rules, each flag with its evidence, sorted by rank (a rank flagged by
    both appears once, under the step-time rule). Step time: the rank's median step exceeds the
    median of rank medians by > 10% and > 1 ms. Own compute: its forward+backward with gradient sync off
    (`busy`: the calibration's `nosync_step_s`) exceeds the median over ranks by as much,
    and its median step is not clearly faster than the others'. This one matters under DDP: every
    step ends in the all-reduce, so only the time before the sync tells the ranks apart."""
    busy = busy or {}
    mid_step = statistics.median(step_medians.values()) if step_medians else 0.0
    out = {r: Straggler(rank=r, rule=STEP_RULE, rank_s=step_medians[r], median_s=mid_step)
           for r in find_stragglers(step_medians)}
    if len(busy) >= 2:
        mid_busy = statistics.median(busy.values())
        for r in find_stragglers(busy):
            step = step_medians.get(r)
            if r in out:
                continue
            if step is not None and step < mid_step * (1 - LOCKSTEP_TOLERANCE) and (
                    mid_step - step > LOCKSTEP_SHARE * (busy[r] - mid_busy)):
                log.debug("rank %d: slow sync-off calibration but a faster median step; not flagged", r)
                continue
            out[r] = Straggler(rank=r, rule=BUSY_RULE, rank_s=busy[r], median_s=mid_busy,
                               step_median_s=step, step_median_of_medians_s=mid_step if step else None)
    return tuple(out[r] for r in sorted(out))


def step_parts(step_s: float, *, data_wait_share: float, exposed_comm_s: float | None,
               nosync_step_s: float | None, accum: int = 1, tp_comm_s: float | None = None) -> dict[str, float]:
    """Seconds of one step by part (compute, exposed_comm, data_wait, other) and `step`; the run
    summary, the verdict and the report's breakdown all use it, so they print the same shares.

    data wait: the rank's measured share of the step; exposed comm: the sync-off/on
    calibration (0 without one) plus tensor parallelism's collectives (`tp_comm_s`, timed
    inside the forward and backward: without async TP each one waits between the matmuls it
    feeds, so all of it is exposed, and the sync-off steps include it); other: step - wait -
    data-parallel exposed - forward/backward with sync off (x accumulation steps), i.e. the
    optimizer and host overhead (0 without the calibration); compute: the rest."""
    wait = min(step_s, max(0.0, data_wait_share) * step_s)
    exposed = min(max(0.0, exposed_comm_s or 0.0), step_s - wait)
    other = max(0.0, step_s - wait - exposed - nosync_step_s * accum) if nosync_step_s is not None else 0.0
    compute = max(0.0, step_s - wait - exposed - other)
    tp = min(max(0.0, tp_comm_s or 0.0), compute)
    return {"compute": compute - tp, "exposed_comm": exposed + tp, "data_wait": wait, "other": other, "step": step_s}


def verdict(shares: Mapping[str, float | None]) -> tuple[str, str]:
    """(name, evidence) of a run's bottleneck from its step-time shares (fractions of the step:
    compute, exposed_comm, data_wait, other). A share given as None was not measured: the evidence
    says so, and compute bound needs exposed communication measured (else NOT_MEASURED_COMM)."""
    wait, comm = shares.get("data_wait"), shares.get("exposed_comm")
    if wait is not None and wait > DATA_BOUND_SHARE:
        return ("data-loading bound",
                f"waiting for batches is {wait:.0%} of the step (> {DATA_BOUND_SHARE:.0%}); "
                "add DataLoader workers (--num-workers) or make batches cheaper")
    if comm is not None and comm > COMM_BOUND_SHARE:
        return ("communication bound",
                f"exposed communication is {comm:.0%} of the step (> {COMM_BOUND_SHARE:.0%}); "
                "a larger per-rank batch, gradient accumulation or a faster link would help")
    other = f", optimizer and host overhead {shares['other']:.0%}" if shares.get("other") else ""
    evidence = (f"compute is {shares.get('compute') or 0.0:.0%} of the step{other}, data wait "
                + ("not measured" if wait is None else f"{wait:.0%}") + ", exposed communication "
                + ("not measured" if comm is None else f"{comm:.0%}"))
    if comm is None:
        return NOT_MEASURED_COMM, evidence + " (the sync-off/on calibration did not run)"
    return "compute bound", evidence


def median_or_none(values: Sequence[float | None]) -> float | None:
    """The median of the values that are present; None when none is."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def run_verdict(ranks: Sequence[RankResult], measured: Sequence[RankResult], *,
                nosync_s: Mapping[int, float] | None = None, accum: int = 1,
                script: bool = False, world_size: int = 1) -> dict[str, Any] | None:
    """The run's bottleneck from the measured shares of the step: {"name", "evidence",
    "shares"}; `verdict`'s rules, plus launch-bound, which only a CUDA profile measures. The
    shares are `step_parts` averaged over ranks (seconds, then / the mean step), as in the
    report's breakdown; `nosync_s`: each rank's sync-off forward+backward. A plain script gets
    NOT_MEASURED: dlaunch sees its step times and data wait, not its communication. None when no
    step was measured."""
    if not measured:
        return None
    if script:
        return {"name": NOT_MEASURED, "shares": {},
                "evidence": "a plain script: dlaunch measures its step times and the time it waits "
                            "on its DataLoader, not its exposed communication, so there is no "
                            "bottleneck verdict (run it as a workload for one)"}
    nosync_s = nosync_s or {}
    per_rank = [step_parts(r.step_time_mean_s or r.step_time_median_s, data_wait_share=min(1.0, r.data_wait_share),
                           exposed_comm_s=r.exposed_comm_s, nosync_step_s=nosync_s.get(r.rank),
                           accum=accum, tp_comm_s=r.tp_comm_s) for r in measured]
    step = statistics.fmean(p["step"] for p in per_rank)
    shares: dict[str, Any] = {k: (statistics.fmean(p[k] for p in per_rank) / step if step else 0.0)
                              for k in ("compute", "exposed_comm", "data_wait", "other")}
    comm_measured = world_size == 1 or any(r.exposed_comm_s is not None or r.tp_comm_s is not None for r in measured)
    name, evidence = verdict({**shares, "exposed_comm": shares["exposed_comm"] if comm_measured else None})
    if not comm_measured:
        shares["exposed_comm"] = None
    if (busy := median_or_none([r.device_busy_share for r in ranks])) is not None:
        shares["device_busy"] = busy
        if name == "compute bound" and busy < LAUNCH_BOUND_BUSY:
            name = "launch bound"
            evidence = (f"the GPU ran kernels {busy:.0%} of the profiled steps (< "
                        f"{LAUNCH_BOUND_BUSY:.0%}) with little batch wait or exposed communication: "
                        "kernel launches and small ops hold it back; try --compile, a larger "
                        "micro-batch, or CUDA graphs (--compile-mode reduce-overhead, DDP only)")
    return {"name": name, "evidence": evidence, "shares": shares}

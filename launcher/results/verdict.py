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
# the own-compute signal must also exceed the median by this much: the calibration has only a
# few samples, and sub-millisecond steps jitter by more than 10%
BUSY_FLOOR_S = 1e-3
# Under synchronous data parallelism every step ends in the same collective, so a rank slow in
# its own compute has a step time equal to the others' or longer. A step-time median clearly
# below the median of medians contradicts the calibration (a few samples, taken before
# training) with the whole run's steady steps, and the steady steps win: no flag.
LOCKSTEP_TOLERANCE = 0.02

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
                    f"medians (+{self.excess:.0%}; the flag needs > +{STRAGGLER_THRESHOLD:.0%})")
        out = (f"own forward+backward with gradient sync off {1000 * self.rank_s:.1f} ms vs "
               f"{1000 * self.median_s:.1f} ms median over ranks (+{self.excess:.0%}; the flag needs "
               f"> +{STRAGGLER_THRESHOLD:.0%} and > +{1000 * BUSY_FLOOR_S:.0f} ms; sync-off calibration)")
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
    return tuple(sorted(r for r, m in medians.items() if mid > 0 and m > mid * (1 + threshold)))


def detect_stragglers(step_medians: Mapping[int, float],
                      busy: Mapping[int, float] | None = None) -> tuple[Straggler, ...]:
    """Slow ranks by two rules, each flag with its evidence, sorted by rank (a rank flagged by
    both appears once, under the step-time rule).

    Step time: the rank's median step exceeds the median of rank medians by > 10%.
    Own compute: the rank's forward+backward with gradient sync off (the calibration's
    `nosync_step_s`, `busy`) exceeds the median over ranks by > 10% and > 1 ms, and its median
    step is not clearly faster than the others'. This one matters under DDP: every step ends in
    the all-reduce, so all ranks share the slow rank's step time and only the time before the
    sync tells them apart.
    """
    busy = busy or {}
    out: dict[int, Straggler] = {}
    mid_step = statistics.median(step_medians.values()) if step_medians else 0.0
    for r in find_stragglers(step_medians):
        out[r] = Straggler(rank=r, rule=STEP_RULE, rank_s=step_medians[r], median_s=mid_step)
    if len(busy) >= 2:
        mid_busy = statistics.median(busy.values())
        for r in find_stragglers(busy):
            step = step_medians.get(r)
            if r in out or busy[r] - mid_busy <= BUSY_FLOOR_S:
                continue
            if step is not None and step < mid_step * (1 - LOCKSTEP_TOLERANCE):
                log.debug("rank %d: slow sync-off calibration but a faster median step; not flagged", r)
                continue
            out[r] = Straggler(rank=r, rule=BUSY_RULE, rank_s=busy[r], median_s=mid_busy,
                               step_median_s=step, step_median_of_medians_s=mid_step if step else None)
    return tuple(out[r] for r in sorted(out))


def verdict(shares: Mapping[str, float]) -> tuple[str, str]:
    """The bottleneck of a run from its step-time shares (fractions of the step: compute,
    exposed_comm, data_wait, other): (name, evidence). Data wait > 20% -> data-loading bound;
    exposed communication > 25% -> communication bound; else compute bound."""
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


def median_or_none(values: Sequence[float | None]) -> float | None:
    """The median of the values that are present; None when none is."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def run_verdict(ranks: Sequence[RankResult], measured: Sequence[RankResult]) -> dict[str, Any] | None:
    """The run's bottleneck from the measured shares of the step, averaged over ranks:
    {"name", "evidence", "shares"}; `verdict`'s rules, plus launch-bound, which only a CUDA
    profile measures."""
    if not measured:
        return None
    waits, comms = [], []
    for r in measured:
        wait = min(1.0, r.data_wait_share)
        share = (r.exposed_comm_s or 0.0) / r.step_time_median_s if r.step_time_median_s else 0.0
        waits.append(wait)
        comms.append(min(share, 1.0 - wait))
    shares = {"data_wait": statistics.fmean(waits), "exposed_comm": statistics.fmean(comms)}
    shares["compute"] = max(0.0, 1.0 - shares["data_wait"] - shares["exposed_comm"])
    name, evidence = verdict(shares)
    busy = median_or_none([r.device_busy_share for r in ranks])
    if busy is not None:
        shares["device_busy"] = busy
        if name == "compute bound" and busy < LAUNCH_BOUND_BUSY:
            name = "launch bound"
            evidence = (f"the GPU ran kernels {busy:.0%} of the profiled steps (< "
                        f"{LAUNCH_BOUND_BUSY:.0%}) with little batch wait or exposed communication: "
                        "kernel launches and small ops hold it back; try --compile, a larger "
                        "micro-batch, or CUDA graphs (--compile-mode reduce-overhead, DDP only)")
    return {"name": name, "evidence": evidence, "shares": shares}

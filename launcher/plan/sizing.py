"""How many GPUs: one plan per world size side by side, and the pick under a deadline or budget.

`dlaunch plan --world-sizes 64,128,...` plans the workload at each size (the same goal and
overrides, nodes = world size / devices per node) and lays the answers out as `SizeRow`s:
strategy, step time, throughput, scaling efficiency against the smallest size, and with a
training goal the time to train, GPU-hours, cost and goodput (`time_to_train`). `pick` names
the cheapest row that meets `--deadline`, or the fastest within `--budget`, and says why each
other row lost. Pure: no torch, no I/O; never imports cli, backends, jobs, runtime or report.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass

from launcher.errors import PlanError, UsageError
from launcher.plan.time_to_train import TimeToTrain, format_duration

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(d|h|m|s)?\s*$")
_UNIT_S = {"d": 86_400.0, "h": 3600.0, "m": 60.0, "s": 1.0, None: 1.0}


@dataclass(frozen=True, kw_only=True)
class SizeRow:
    """The plan at one world size."""

    world_size: int
    nodes: int
    label: str  # the chosen strategy, as the plan labels it
    step_s: float  # predicted
    units_per_s: float  # samples (or tokens) per second, all GPUs
    efficiency: float  # per-GPU throughput over that of the smallest size planned
    ttt: TimeToTrain | None  # None without a training goal

    @property
    def cost_key(self) -> float:
        """What cheaper means: the cost when priced, else GPU-hours (inf without a goal)."""
        if self.ttt is None:
            return float("inf")
        return self.ttt.cost if self.ttt.cost is not None else self.ttt.gpu_hours


def parse_world_sizes(text: str) -> tuple[int, ...]:
    """`64,128,256` -> (64, 128, 256); UsageError for anything else."""
    try:
        sizes = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        sizes = ()
    if not sizes or any(n < 1 for n in sizes):
        raise UsageError(f"--world-sizes takes GPU counts separated by commas, e.g. 64,128,256; got {text!r}")
    return tuple(sorted(set(sizes)))


def parse_duration_s(text: str) -> float:
    """`30d`, `12h`, `90m`, `3600s` or `3600` (seconds) in seconds; UsageError otherwise."""
    m = _DURATION.match(text)
    if m is None or float(m.group(1)) <= 0:
        raise UsageError(f"--deadline takes a positive duration such as 30d, 12h or 90m; got {text!r}")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


def _amount(x: float) -> str:
    """A cost or GPU-hours: whole units from 100 up, three significant digits below."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def with_efficiency(rows: Sequence[SizeRow]) -> list[SizeRow]:
    """`rows` with each one's per-GPU throughput over that of the smallest world size."""
    if not rows:
        return []
    base = min(rows, key=lambda r: r.world_size)
    per_gpu = base.units_per_s / base.world_size
    return [dataclasses.replace(r, efficiency=r.units_per_s / r.world_size / per_gpu) for r in rows]


def pick(rows: Sequence[SizeRow], *, deadline_s: float | None = None,
         budget: float | None = None) -> tuple[SizeRow, list[str]]:
    """The cheapest row that trains within `deadline_s` and `budget` (with only a budget: the
    fastest within it), and a line per other row saying why it lost. PlanError when none can."""
    if any(r.ttt is None for r in rows):
        raise UsageError("--deadline and --budget need a training goal: add --tokens, --samples or --train-steps")
    priced = all(r.ttt is not None and r.ttt.cost is not None for r in rows)
    money = "cost" if priced else "GPU-hours"

    def fails(r: SizeRow) -> str | None:
        assert r.ttt is not None
        if deadline_s is not None and r.ttt.wall_s > deadline_s:
            return f"takes {format_duration(r.ttt.wall_s)}, past the deadline of {format_duration(deadline_s)}"
        if budget is not None and r.cost_key > budget:
            return f"{money} {_amount(r.cost_key)} is over the budget of {_amount(budget)}"
        return None

    meets = [r for r in rows if fails(r) is None]
    if not meets:
        fastest = min(rows, key=lambda r: r.ttt.wall_s if r.ttt else float("inf"))
        raise PlanError(f"no world size planned meets the {'deadline' if deadline_s else 'budget'}: "
                        f"{fastest.world_size} GPUs {fails(fastest)}; try more GPUs or "
                        + " or ".join(w for w, given in (("a later deadline", deadline_s), ("a larger budget", budget))
                                      if given is not None))
    if deadline_s is not None:
        best = min(meets, key=lambda r: (r.cost_key, r.ttt.wall_s if r.ttt else 0.0))
        won = f"the cheapest ({money}) that meets the deadline"
    else:
        best = min(meets, key=lambda r: (r.ttt.wall_s if r.ttt else 0.0, r.cost_key))
        won = "the fastest within the budget"
    why = [f"{best.world_size} GPUs: {won}"]
    for r in rows:
        if r is best:
            continue
        lost = (f"{money} {_amount(r.cost_key)} against {_amount(best.cost_key)}" if deadline_s is not None
                else f"slower: {format_duration(r.ttt.wall_s if r.ttt else 0.0)}")
        why.append(f"{r.world_size} GPUs: {fails(r) or lost}")
    return best, why


__all__ = ["SizeRow", "parse_world_sizes", "parse_duration_s", "with_efficiency", "pick"]

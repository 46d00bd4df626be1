"""The values a report is made of: points, rows, a tune's trials, the report, and scaling efficiency.

Plain dataclasses and two pure functions, so the modules that fill a report (`scaling`,
`predict`, `tune`) and the ones that draw it (`plots`, `html`, `render`) share them without
importing each other. Imports nothing from dlaunch; never imports matplotlib.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# the step-time breakdown's parts (seconds per optimizer step; see `scaling.breakdown`)
PARTS = ("compute", "exposed_comm", "data_wait", "other")
HTML_PAGE = "report.html"  # the page's name in a report folder
TRIAL_STATUSES = ("ok", "failed", "skipped")  # a tune trial: measured, failed, never started
GROUP_AXIS = {"rank": "rank", "node": "node", "rank block": "ranks"}  # a per-rank plot's grouping -> axis label


@dataclass(kw_only=True)
class Point:
    """One run of a sweep (or the lone run of a run directory), with what the report shows."""

    name: str
    world_size: int
    repeat: int
    status: str
    run_dir: str
    run_id: str = ""
    status_text: str = ""  # the status as shown ("ok, no steps reported"); `status` when empty
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
    # predicted (plan.json) against measured step time and memory: results.prediction's block
    prediction: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)  # the run's (results.plausibility)


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
    predicted_interval_s: tuple[float, float] | None = None  # the plan's 80% interval
    predicted_samples_per_s: float | None = None
    predicted_efficiency: float | None = None


def _positive(value: float | None, name: str, *, optional: bool = True) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a number > 0{' or null' if optional else ''}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class TuneTrial:
    """One row of a tune's table, as tune.json recorded it; measured values are None unless measured."""

    name: str  # the candidate, e.g. "DDP fp32 + ckpt, mb 8 x 1"
    run_name: str  # its run dir's name under the tune dir, e.g. "1-ddp-fp32-ckpt-mb8"
    status: str  # one of TRIAL_STATUSES
    reason: str = ""  # why it failed or was skipped
    predicted_step_s: float
    predicted_samples_per_s: float
    predicted_interval_s: tuple[float, float] | None = None  # the plan's 80% interval
    measured_step_s: float | None = None
    measured_samples_per_s: float | None = None
    step_ratio: float | None = None  # measured / predicted step time
    chosen: bool = False
    run_dir: str | None  # absolute; None when the trial never had one (skipped)
    report_html: str | None = None  # the trial's own report page, when one was written

    def __post_init__(self) -> None:
        if self.status not in TRIAL_STATUSES:
            raise ValueError(f"trial status must be one of {', '.join(TRIAL_STATUSES)}, got {self.status!r}")
        if not self.name or not self.run_name or "/" in self.run_name or self.run_name in (".", ".."):
            raise ValueError(f"a trial needs a name and a plain run dir name, got {self.name!r}, {self.run_name!r}")
        for name in ("predicted_step_s", "predicted_samples_per_s", "measured_step_s", "measured_samples_per_s",
                     "step_ratio"):
            _positive(getattr(self, name), name, optional=not name.startswith("predicted"))
        if self.status != "ok" and (self.measured_step_s is not None or self.chosen):
            raise ValueError(f"trial {self.name!r} is {self.status}: nothing measured, never chosen")


@dataclass(frozen=True, kw_only=True)
class TuneSummary:
    """A tune directory's trials and outcome (`dlaunch tune`'s table), for its report."""

    world_size: int
    trials: tuple[TuneTrial, ...]
    tuned_plan: str | None  # tuned-plan.json's path, when the tune wrote one
    workload: str = ""  # the workload tuned-plan.json names, "" when unknown

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {self.world_size!r}")
        if sum(t.chosen for t in self.trials) > 1:
            raise ValueError("more than one trial is marked chosen")

    @property
    def chosen(self) -> TuneTrial | None:
        """The fastest measured trial, the one the tuned plan repeats."""
        return next((t for t in self.trials if t.chosen), None)


@dataclass(kw_only=True)
class ScalingReport:
    """Everything `dlaunch report` shows, as plain values (report.json is its asdict)."""

    kind: str  # sweep | run | runs | tune
    source: str
    mode: str  # weak | strong
    sample_units: str
    baseline_world_size: int | None
    rows: list[Row]
    points: list[Point]
    prediction_note: str | None = None
    link_note: str | None = None
    notes: list[str] = field(default_factory=list)
    # implausible numbers: each point's warnings and superlinear efficiency, one line each
    warnings: list[str] = field(default_factory=list)
    tune: TuneSummary | None = None  # kind "tune": the table of `dlaunch tune`

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return dataclasses.asdict(self)

    def note_lines(self) -> list[str]:
        """What could not be read, failures, and why a column is empty: one line each."""
        lines = [f"{p.name}: {n}" for p in self.points for n in p.unreadable]
        lines += [f"{p.name}: FAILED: {f}" for p in self.points for f in p.failures]
        return lines + [n for n in (*self.notes, self.prediction_note, self.link_note) if n]

    @property
    def live(self) -> bool:
        """A run in it is still going: its numbers are the steps so far."""
        return any(p.status == "running" for p in self.points)

    def headline(self) -> str:
        """What the report is about, in words: one run is not a scaling study."""
        if self.tune is not None:
            return f"tune of {len(self.tune.trials)} candidate(s)"
        what = ((f"one run on {self.points[0].world_size} rank(s)" if self.points else "one run")
                if self.kind == "run" else f"{self.mode} scaling")
        return what + (", live: a run is still in progress, numbers are its steps so far" if self.live else "")


def dash(x: float | None, fmt: str) -> str:
    """`x` formatted with `fmt`, or "-" where nothing was measured (None)."""
    return "-" if x is None else fmt.format(x)


def efficiency(mode: str, *, n0: int, n: int, throughput_n0: float, throughput_n: float,
               step_n0: float | None, step_n: float | None) -> float | None:
    """Weak: throughput(N) / (N/N0 x throughput(N0)); strong: T(N0) x N0 / (N x T(N))."""
    if mode == "strong":
        return step_n0 * n0 / (n * step_n) if step_n and step_n0 is not None else None
    return throughput_n / (throughput_n0 * n / n0) if throughput_n0 else None

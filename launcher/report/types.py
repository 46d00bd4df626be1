"""The values a scaling report is made of: points, rows, the report, and scaling efficiency.

Plain dataclasses and one pure function, so the modules that fill a report (`scaling`,
`predict`) and the ones that draw it (`plots`, `html`, `render`) share them without importing
each other. Imports nothing from dlaunch; never imports matplotlib.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# the step-time breakdown's parts (seconds per optimizer step; see `scaling.breakdown`)
PARTS = ("compute", "exposed_comm", "data_wait", "other")


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
    # implausible numbers: each point's warnings and superlinear efficiency, one line each
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return dataclasses.asdict(self)


def efficiency(mode: str, *, n0: int, n: int, throughput_n0: float, throughput_n: float,
               step_n0: float | None, step_n: float | None) -> float | None:
    """Weak: throughput(N) / (N/N0 x throughput(N0)); strong: T(N0) x N0 / (N x T(N))."""
    if mode == "strong":
        if not step_n or step_n0 is None:
            return None
        return step_n0 * n0 / (n * step_n)
    return throughput_n / (throughput_n0 * n / n0) if throughput_n0 else None

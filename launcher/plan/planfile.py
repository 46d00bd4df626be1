"""plan.json, the plan a run followed, kept in its run dir: `write_plan` writes it, `read_plan`
gives its readers (predicted against measured, the report, the progress line, `run --plan`) what
they take of it as a `PlanFile`: None where a file lacks it (older ones: the interval, the
profile), each reader requiring what it uses; older files' checkpointing bool is its mode.

No torch; never imports cli, backends, jobs, runtime, results or report.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher.files import atomic_write_json
from launcher.knobs import migrate
from launcher.plan.types import MemoryEstimate, StepTimeEstimate
from launcher.rundir import RunPaths

if TYPE_CHECKING:
    from launcher.plan.resolve import Planned


@dataclass(frozen=True, kw_only=True)
class PlanFile:
    """What plan.json's readers take from it: the chosen candidate's predictions and decisions (None: absent)."""

    time: StepTimeEstimate | None = None
    memory: MemoryEstimate | None = None
    strategy: str | None = None
    precision: str | None = None
    micro_batch: int | None = None
    grad_accum: int | None = None
    world_size: int | None = None
    checkpointing: str | None = None
    compile: bool | None = None
    tp: int | None = None
    reduce_dtype: str | None = None
    fsdp_unit: str | None = None
    # the kernels the plan was told (`--attention-kernel`, ...): a run that follows the plan
    # prices and records them again; detected and declared ones it finds again by itself
    attention_kernel: str | None = None
    loss_kernel: str | None = None
    norm_kernel: str | None = None
    units_per_s: float | None = None
    interval: tuple[float, float, float] | None = None  # (low_s, high_s, coverage)
    sample_units: str | None = None  # the profile's, None without one
    units_per_sample: int = 1


def write_plan(run_dir: str | Path, planned: Planned) -> None:
    """Keep the plan beside the run, so reports can set predicted against measured."""
    atomic_write_json(RunPaths(root=Path(run_dir)).plan, {
        "plan": planned.plan.to_dict(), "profile": dataclasses.asdict(planned.profile),
        "topology": planned.topology.name})


def _interval(found: Any) -> tuple[float, float, float] | None:
    try:
        return float(found["low_s"]), float(found["high_s"]), float(found["coverage"])
    except (KeyError, TypeError, ValueError):
        return None  # a plan written before plans had one


def read_plan(data: Mapping[str, Any]) -> PlanFile:
    """plan.json's content; KeyError, TypeError or ValueError when it holds no chosen plan, or a malformed part."""
    plan, profile = data["plan"], data.get("profile") or {}
    # the strategy's fields flat, in today's names (`knobs.migrate`: older files' spellings)
    chosen = migrate({**plan["chosen"], "strategy": {"kind": None, **(plan["chosen"].get("strategy") or {})}})
    time, memory = chosen.get("time"), chosen.get("memory")
    given = {f"{role}_kernel": k["kernel"] for role, k in (plan.get("kernels") or {}).items()
             if isinstance(k, Mapping) and k.get("source") == "given"}
    return PlanFile(
        time=None if time is None else StepTimeEstimate(**time),
        memory=None if memory is None else MemoryEstimate(**memory),
        strategy=chosen["strategy"], precision=chosen.get("precision"),
        micro_batch=chosen.get("micro_batch"), grad_accum=chosen.get("grad_accum"),
        world_size=plan.get("world_size"), compile=chosen.get("compile"),
        checkpointing=chosen.get("checkpointing"), tp=chosen.get("tp"),
        reduce_dtype=chosen.get("reduce_dtype"), fsdp_unit=chosen.get("fsdp_unit"), **given,
        units_per_s=None if plan.get("units_per_s") is None else float(plan["units_per_s"]),
        interval=_interval(plan.get("step_interval")), sample_units=profile.get("sample_units"),
        units_per_sample=int(profile.get("units_per_sample", 1)))

"""Predicted against measured: the plan a run followed (plan.json) beside what the run measured.

The block lands in `result.json` (`RunResult.prediction`), one line of the run summary and the
report. Without a plan it says so and carries no number: a prediction is never made up here.

Memory is compared per rank: the plan's predicted peak of one rank against the largest
measured peak over ranks, and the block names what was measured. Both devices count tensors
only, as the plan does: on CUDA `torch.cuda.max_memory_allocated` (no CUDA context or allocator
cache), on CPU the peak of live tensor storages over one sampled step (runtime.live_bytes),
never the process's resident set (which includes the Python and torch runtime).

Never imports report, jobs, backends, cli or runtime.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from launcher.plan.types import MemoryEstimate, StepTimeEstimate
from launcher.results.types import RankResult
from launcher.specs import GIB, LaunchSpec

log = logging.getLogger(__name__)

NO_PLAN = "no plan"
MEASURED_MEM = {
    "cuda": "peak allocated by torch (torch.cuda.max_memory_allocated), largest rank",
    "cpu": "peak live tensor bytes of a sampled step (runtime.live_bytes), largest rank",
}


def measured_peak_bytes(ranks: Sequence[RankResult], device: str) -> int | None:
    """The largest per-rank peak the plan's memory estimate is compared with: live tensor
    bytes on CPU, bytes allocated by torch elsewhere; None when no rank measured it."""
    peaks = [r.live_peak_bytes if device == "cpu" else r.peak_mem_bytes for r in ranks]
    present = [p for p in peaks if p is not None]
    return max(present) if present else None


def plan_step_time_s(plan: Mapping[str, Any]) -> float:
    """The step time plan.json predicts for its chosen candidate (KeyError/TypeError/ValueError
    when it is not a plan written by `dlaunch run`)."""
    return StepTimeEstimate(**plan["plan"]["chosen"]["time"]).step_time_s


def plan_mem_gib(plan: Mapping[str, Any]) -> float:
    """The per-rank peak memory plan.json predicts for its chosen candidate."""
    return MemoryEstimate(**plan["plan"]["chosen"]["memory"]).total_gib


def _mismatch(plan: Mapping[str, Any], spec: LaunchSpec) -> str | None:
    """Why the run did not follow the plan (the user changed a decision after planning), or None."""
    chosen = plan["plan"]["chosen"]
    strategy = chosen["strategy"]
    pairs = [("strategy", strategy["kind"], spec.strategy.kind),
             ("precision", strategy["precision"], spec.strategy.precision),
             ("micro-batch", chosen["micro_batch"], spec.micro_batch),
             ("accumulation", chosen["grad_accum_steps"], spec.grad_accum_steps),
             ("world size", plan["plan"]["world_size"], spec.world_size)]
    diff = [f"{name} {a} planned, {b} run" for name, a, b in pairs if a != b]
    return "the run did not follow plan.json: " + ", ".join(diff) if diff else None


def compare(plan: Mapping[str, Any] | None, spec: LaunchSpec, *, step_time_s: float | None,
            peak_mem_bytes: int | None, device: str) -> dict[str, Any]:
    """The prediction block: predicted and measured step time and memory, and measured/predicted.

    `plan`: plan.json's content, None without one. `step_time_s`: the measured median step (None
    when no step was measured); `peak_mem_bytes`: the largest peak over ranks.
    Returns {"available": False, "reason"} when there is nothing honest to compare.
    """
    if plan is None:
        return {"available": False, "reason": NO_PLAN}
    try:
        predicted_s, predicted_gib = plan_step_time_s(plan), plan_mem_gib(plan)
        mismatch = _mismatch(plan, spec)
    except (KeyError, TypeError, ValueError) as e:
        log.debug("plan.json unusable", exc_info=True)
        return {"available": False, "reason": f"plan.json unreadable ({type(e).__name__}: {e})"}
    if mismatch:
        return {"available": False, "reason": mismatch}
    measured_gib = peak_mem_bytes / GIB if peak_mem_bytes is not None else None
    return {
        "available": True, "source": "plan.json",
        "step_time_s": predicted_s, "mem_gib": predicted_gib,
        "measured_step_time_s": step_time_s, "measured_mem_gib": measured_gib,
        "measured_mem_kind": MEASURED_MEM.get(device, f"peak memory on {device}, largest rank"),
        "step_time_ratio": step_time_s / predicted_s if step_time_s and predicted_s > 0 else None,
        "mem_ratio": measured_gib / predicted_gib if measured_gib is not None and predicted_gib > 0 else None,
    }


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def prediction_cell(block: Mapping[str, Any] | None) -> str:
    """The same comparison in a table cell: measured/predicted for step time and memory."""
    if not block or not block.get("available"):
        return "not available (" + ((block or {}).get("reason") or NO_PLAN) + ")"
    return (f"step {block['step_time_s']:.3f} s pred., {_num(block['measured_step_time_s'], '{:.3f} s')} "
            f"meas. ({_num(block['step_time_ratio'], '{:.2f}')}); mem {block['mem_gib']:.2f} GiB pred., "
            f"{_num(block['measured_mem_gib'], '{:.2f} GiB')} meas. ({_num(block['mem_ratio'], '{:.2f}')})")


def prediction_line(block: Mapping[str, Any] | None) -> str:
    """The one summary line: predicted, measured and measured/predicted for step time and memory."""
    if not block or not block.get("available"):
        reason = (block or {}).get("reason") or NO_PLAN
        return f"prediction: not available ({reason})"
    return (f"prediction vs measured (plan.json): step time {block['step_time_s']:.3f} s predicted, "
            f"{_num(block['measured_step_time_s'], '{:.3f} s')} measured median "
            f"(measured/predicted {_num(block['step_time_ratio'], '{:.2f}')}); memory per rank "
            f"{block['mem_gib']:.2f} GiB predicted, {_num(block['measured_mem_gib'], '{:.2f} GiB')} "
            f"measured as {block['measured_mem_kind']} (measured/predicted {_num(block['mem_ratio'], '{:.2f}')})")

"""Predicted against measured: the plan a run followed (plan.json) beside what the run measured.

The block lands in `result.json` (`RunResult.prediction`), one line of the run summary and the
report. Without a plan it says so and carries no number: a prediction is never made up here.

Memory is compared per rank, like with like: tensors against tensors. The predicted side is
the plan's tensor part (`plan_tensor_bytes`), never its total, which on CUDA adds the CUDA
context, NCCL buffers and allocator slack that no tensor counter sees. The measured side is the
largest peak over ranks, and the block names it: on CUDA `torch.cuda.max_memory_allocated` over
the steady steps (the rank resets the peak at the first steady step, runtime.window, so compile
autotuning and warm-up are left out), on CPU the peak of live tensor storages over one sampled
step (runtime.live_bytes), never the process's resident set (which includes the Python and
torch runtime). `mem_total_gib` is the plan's whole estimate, what nvidia-smi would show.

Never imports report, jobs, backends, cli or runtime.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from launcher.plan.memory import CUDA_ALLOCATOR_SLACK, CUDA_CONTEXT_BYTES, NCCL_BUFFER_BYTES
from launcher.plan.planfile import PlanFile, read_plan
from launcher.plan.types import MemoryEstimate
from launcher.results.types import RankResult
from launcher.runspec import LaunchSpec
from launcher.specs import GIB

log = logging.getLogger(__name__)

NO_PLAN = "no plan"
# what the comparison reads of plan.json (`PlanFile`): a plan without one is unreadable here
_COMPARED = ("time", "memory", "strategy", "precision", "micro_batch", "grad_accum", "world_size")
MEASURED_MEM = {
    "cuda": "peak allocated by torch over the steady steps (torch.cuda.max_memory_allocated), largest rank",
    "cpu": "peak live tensor bytes of a sampled step (runtime.live_bytes), largest rank",
}


def measured_peak_bytes(ranks: Sequence[RankResult], device: str) -> int | None:
    """The largest per-rank peak the plan's memory estimate is compared with: live tensor
    bytes on CPU, bytes allocated by torch elsewhere; None when no rank measured it."""
    peaks = (r.live_peak_bytes if device == "cpu" else r.peak_mem_bytes for r in ranks)
    return max((p for p in peaks if p is not None), default=None)


def plan_tensor_bytes(est: MemoryEstimate, *, device: str, world_size: int) -> float:
    """The tensor part of a per-rank estimate: what `max_memory_allocated` (CUDA) or the live
    tensor bytes (CPU) can be compared with. plan.memory puts FSDP's unsharded units and the
    cuBLAS workspaces (tensors) into `overhead_bytes` beside, on CUDA only, the context, NCCL
    buffers (more than one rank) and allocator slack (a fraction of the tensors): total =
    (1 + slack) x tensors + context + NCCL, which this inverts. Never below the named tensor terms."""
    named = est.params_bytes + est.grads_bytes + est.optimizer_bytes + est.activations_bytes
    if device != "cuda":
        return est.total_bytes  # no overhead counted off CUDA: every byte is a tensor's
    fixed = CUDA_CONTEXT_BYTES + (NCCL_BUFFER_BYTES if world_size > 1 else 0.0)
    return max(named, (est.total_bytes - fixed) / (1.0 + CUDA_ALLOCATOR_SLACK))


def _mismatch(plan: PlanFile, spec: LaunchSpec) -> str | None:
    """Why the run did not follow the plan (the user changed a decision after planning), or None."""
    pairs = [("strategy", plan.strategy, spec.strategy), ("precision", plan.precision, spec.precision),
             ("micro-batch", plan.micro_batch, spec.micro_batch), ("accumulation", plan.grad_accum, spec.grad_accum),
             ("world size", plan.world_size, spec.world_size),
             *([("reduce dtype", plan.reduce_dtype, spec.reduce_dtype)] if plan.reduce_dtype is not None else []),
             *([("FSDP unit", plan.fsdp_unit, spec.fsdp_unit)] if plan.fsdp_unit is not None else [])]
    diff = [f"{name} {a} planned, {b} run" for name, a, b in pairs if a != b]
    return "the run did not follow plan.json: " + ", ".join(diff) if diff else None


def compare(plan: Mapping[str, Any] | None, spec: LaunchSpec, *, step_time_s: float | None,
            peak_mem_bytes: int | None, device: str) -> dict[str, Any]:
    """The prediction block: predicted and measured step time and memory, and measured/predicted.

    `plan`: plan.json's content, None without one. `step_time_s`: the measured median step (None
    when none was measured); `peak_mem_bytes`: `measured_peak_bytes`. `mem_gib` is the plan's
    tensor part, the one compared (`mem_ratio`); `mem_total_gib` its whole estimate (the same off
    CUDA). {"available": False, "reason"} when there is nothing honest to compare."""
    if plan is None:
        return {"available": False, "reason": NO_PLAN}
    try:
        planned = read_plan(plan)
        if absent := [k for k in _COMPARED if getattr(planned, k) is None]:
            raise KeyError(absent[0])
        time, memory, world = planned.time, planned.memory, planned.world_size
        assert time is not None and memory is not None and world is not None  # _COMPARED
        predicted_s, total_gib = time.step_time_s, memory.total_gib
        predicted_gib = plan_tensor_bytes(memory, device=device, world_size=int(world)) / GIB
        mismatch = _mismatch(planned, spec)
    except (KeyError, TypeError, ValueError) as e:
        log.debug("plan.json unusable", exc_info=True)
        return {"available": False, "reason": f"plan.json unreadable ({type(e).__name__}: {e})"}
    if mismatch:
        return {"available": False, "reason": mismatch}
    measured_gib = peak_mem_bytes / GIB if peak_mem_bytes is not None else None
    low_s, high_s, coverage = planned.interval or (None, None, None)
    inside = None if step_time_s is None or low_s is None or high_s is None else low_s <= step_time_s <= high_s
    return {
        "step_interval_s": None if low_s is None else [low_s, high_s], "interval_coverage": coverage,
        "inside_interval": inside, "available": True, "source": "plan.json",
        "step_time_s": predicted_s, "mem_gib": predicted_gib, "mem_total_gib": total_gib,
        "measured_step_time_s": step_time_s, "measured_mem_gib": measured_gib,
        "measured_mem_kind": MEASURED_MEM.get(device, f"peak memory on {device}, largest rank"),
        "step_time_ratio": step_time_s / predicted_s if step_time_s and predicted_s > 0 else None,
        "mem_ratio": measured_gib / predicted_gib if measured_gib is not None and predicted_gib > 0 else None,
    }


def interval_note(block: Mapping[str, Any]) -> str:
    """' (0.47-0.64 s, 80%)' after a predicted step time, or '' without an interval."""
    span = block.get("step_interval_s")
    return f" ({span[0]:.3g}-{span[1]:.3g} s, {block['interval_coverage']:.0%})" if span else ""


def _inside_note(block: Mapping[str, Any]) -> str:
    inside = block.get("inside_interval")
    return "" if inside is None else ", inside the interval" if inside else ", OUTSIDE the interval"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def prediction_cell(block: Mapping[str, Any] | None) -> str:
    """The same comparison in a table cell: measured/predicted for step time and memory."""
    if not block or not block.get("available"):
        return "not available (" + ((block or {}).get("reason") or NO_PLAN) + ")"
    return (f"step {block['step_time_s']:.3f} s pred.{interval_note(block)}, "
            f"{_num(block['measured_step_time_s'], '{:.3f} s')} meas. ({_num(block['step_time_ratio'], '{:.2f}')}"
            f"{_inside_note(block)}); mem {block['mem_gib']:.2f} GiB pred., "
            f"{_num(block['measured_mem_gib'], '{:.2f} GiB')} meas. ({_num(block['mem_ratio'], '{:.2f}')})")


def prediction_line(block: Mapping[str, Any] | None) -> str:
    """The one summary line: predicted, measured and measured/predicted for step time and memory."""
    if not block or not block.get("available"):
        return "prediction: " + prediction_cell(block)
    return (f"prediction vs measured (plan.json): step time {block['step_time_s']:.3f} s predicted"
            f"{interval_note(block)}, {_num(block['measured_step_time_s'], '{:.3f} s')} measured median "
            f"(measured/predicted {_num(block['step_time_ratio'], '{:.2f}')}{_inside_note(block)}); memory per rank "
            f"{block['mem_gib']:.2f} GiB predicted, {_num(block['measured_mem_gib'], '{:.2f} GiB')} "
            f"measured as {block['measured_mem_kind']} (measured/predicted {_num(block['mem_ratio'], '{:.2f}')})"
            + _total_note(block))


def _total_note(block: Mapping[str, Any]) -> str:
    """On CUDA: the plan's whole estimate beside the tensor part compared (older blocks: none)."""
    total = block.get("mem_total_gib")
    if total is None or abs(total - block["mem_gib"]) < 0.005:
        return ""
    return (f"; with the CUDA context, NCCL buffers and allocator slack the plan expects "
            f"{total:.2f} GiB per rank (what nvidia-smi would show)")

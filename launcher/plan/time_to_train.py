"""Time to train, GPU-hours, cost and goodput of a chosen plan: how long a training goal takes.

A goal (tokens, samples or optimizer steps) over the plan's throughput is the ideal time; a long
run on many GPUs also loses time to checkpoints and to failures. From physics and one published
failure rate, each assumption named in the result:
- failures: unexpected interruptions arrive at a rate per GPU-hour (default: Llama 3's pre-training,
  419 in a 54-day snapshot on up to 16,384 H100s, "The Llama 3 Herd of Models", arXiv 2407.21783,
  section 3.3.4: one per ~50,700 GPU-hours), so a job on N GPUs fails every MTBF_gpu / N hours;
- checkpoints: the model and optimizer state (the plan's per-rank state bytes, every rank of a
  node writing at once) over the storage's write bandwidth per node take `save_s`; saving every
  `interval_s` (Young/Daly's optimum sqrt(2 x save_s x MTBF_job)) costs save_s / interval_s of
  the time; each failure loses half an interval of work on average plus the restart;
- goodput = the share of wall time that trains: 1 - save_s / interval_s - (interval_s / 2 +
  restart_s) / MTBF_job (first order; a failure during a save is ignored).

Pure: no torch, no I/O; never imports cli, backends, jobs, runtime, results or report.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from launcher.errors import PlanError, UsageError

# Llama 3 (arXiv 2407.21783, 3.3.4): 419 unexpected interruptions, 54 days, 16,384 GPUs
LLAMA3_INTERRUPTIONS = 419
LLAMA3_GPU_HOURS = 54 * 24 * 16_384
MTBF_GPU_HOURS = LLAMA3_GPU_HOURS / LLAMA3_INTERRUPTIONS  # ~50,700 GPU-hours per interruption
# An assumption: write bandwidth of the checkpoint storage per node (a parallel file system's
# share, or local NVMe); --ckpt-write-gb-s sets it
CKPT_WRITE_GB_S_PER_NODE = 2.0
# An assumption: from a failure to training again (detect, requeue, start, NCCL init, load)
RESTART_S = 600.0
_GOAL_KINDS = ("tokens", "samples", "steps")


@dataclass(frozen=True, kw_only=True)
class TrainGoal:
    """What to train: exactly one of tokens, samples or optimizer steps."""

    tokens: float | None = None
    samples: float | None = None
    steps: float | None = None

    def __post_init__(self) -> None:
        given = [(k, v) for k in _GOAL_KINDS if (v := getattr(self, k)) is not None]
        if len(given) != 1:
            raise UsageError(f"give one training goal: --tokens N, --samples N or --train-steps N, got {len(given)}")
        name, value = given[0]
        if not (math.isfinite(value) and value > 0):
            raise UsageError(f"--{name} must be a finite number > 0 (e.g. 1e12), got {value}")


@dataclass(frozen=True, kw_only=True)
class GoodputModel:
    """The failure and checkpoint assumptions (defaults: see the module docstring)."""

    mtbf_gpu_hours: float = MTBF_GPU_HOURS
    ckpt_write_gb_s_per_node: float = CKPT_WRITE_GB_S_PER_NODE
    restart_s: float = RESTART_S
    gpu_hour_price: float | None = None  # currency per GPU-hour; None: no cost

    def __post_init__(self) -> None:
        for name in ("mtbf_gpu_hours", "ckpt_write_gb_s_per_node"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise UsageError(f"--{name.replace('_', '-')} must be a finite number > 0, got {value}")
        if not (math.isfinite(self.restart_s) and self.restart_s >= 0):
            raise UsageError(f"restart time must be >= 0 s, got {self.restart_s}")
        if (price := self.gpu_hour_price) is not None and not (math.isfinite(price) and price >= 0):
            raise UsageError(f"--gpu-hour-price must be a finite number >= 0, got {price}")


@dataclass(frozen=True, kw_only=True)
class PlanRate:
    """What the chosen plan delivers, as time_to_train needs it."""

    step_s: float  # one optimizer step, predicted
    global_batch: int  # samples per optimizer step
    units_per_sample: int  # tokens per sample (1 for models without tokens)
    world_size: int
    devices_per_node: int
    state_bytes_per_rank: float  # parameters + optimizer state a checkpoint writes per rank

    def __post_init__(self) -> None:
        if not (self.step_s > 0 and self.global_batch > 0 and self.units_per_sample > 0
                and self.world_size > 0 and self.devices_per_node > 0
                and self.state_bytes_per_rank >= 0):
            raise PlanError(f"a plan rate needs positive step time, batch and sizes, got {self}")


@dataclass(frozen=True, kw_only=True)
class TimeToTrain:
    """The answer, every term itemised (seconds, hours, the share of wall time)."""

    steps: int
    ideal_s: float  # steps x step time: training only
    checkpoint_save_s: float  # one save
    checkpoint_interval_s: float  # Young/Daly
    checkpoint_loss_s: float  # time spent saving over the run
    expected_failures: float
    failure_loss_s: float  # lost work (half an interval each) + restarts
    wall_s: float
    goodput: float  # ideal_s / wall_s
    gpu_hours: float
    cost: float | None
    assumptions: tuple[str, ...]

    @property
    def days(self) -> float:
        """The wall time in days."""
        return self.wall_s / 86_400


def goal_steps(goal: TrainGoal, rate: PlanRate) -> int:
    """Optimizer steps to reach the goal (the last step rounded up)."""
    if goal.steps is not None:
        return math.ceil(goal.steps)
    samples = goal.samples if goal.samples is not None else (goal.tokens or 0) / rate.units_per_sample
    return max(1, math.ceil(samples / rate.global_batch))


def time_to_train(goal: TrainGoal, rate: PlanRate, model: GoodputModel | None = None) -> TimeToTrain:
    """How long `goal` takes at `rate`, with what checkpoints and failures cost."""
    m = model or GoodputModel()
    steps = goal_steps(goal, rate)
    ideal = steps * rate.step_s
    mtbf_job_s = m.mtbf_gpu_hours * 3600 / rate.world_size
    save = rate.state_bytes_per_rank * min(rate.devices_per_node, rate.world_size) / (m.ckpt_write_gb_s_per_node * 1e9)
    # Young/Daly; never more often than once a step, never beyond the run
    interval = min(max(math.sqrt(2 * save * mtbf_job_s), rate.step_s), max(ideal, rate.step_s))
    # the overheads scale the wall time: solve wall = ideal + wall x (overhead share)
    lost_share = (save / interval if save > 0 else 0.0) + (interval / 2 + m.restart_s) / mtbf_job_s
    if lost_share >= 1:
        raise PlanError(f"the job fails every {mtbf_job_s / 3600:.2g} h on {rate.world_size} GPUs, faster than it can "
                        f"checkpoint ({save:.0f} s a save) and restart ({m.restart_s:.0f} s): it would never finish; "
                        "use fewer GPUs or faster checkpoint storage (--ckpt-write-gb-s)")
    wall = ideal / (1 - lost_share)
    failures = wall / mtbf_job_s
    gpu_hours = wall * rate.world_size / 3600
    assumptions = (
        f"one interruption per {m.mtbf_gpu_hours:,.0f} GPU-hours"
        + (" (Llama 3 pre-training: 419 in 54 days on 16,384 H100s, arXiv 2407.21783)"
           if m.mtbf_gpu_hours == MTBF_GPU_HOURS else " (given)"),
        f"checkpoint storage writes {m.ckpt_write_gb_s_per_node:g} GB/s per node"
        + (" (an assumption: --ckpt-write-gb-s)" if m.ckpt_write_gb_s_per_node == CKPT_WRITE_GB_S_PER_NODE
           else " (given)"),
        f"a restart takes {m.restart_s / 60:.0f} min (an assumption)",
        "the step time is the plan's prediction; failures during a save are ignored",
    )
    return TimeToTrain(
        steps=steps, ideal_s=ideal, checkpoint_save_s=save, checkpoint_interval_s=interval,
        checkpoint_loss_s=wall * (save / interval if save > 0 else 0.0), expected_failures=failures,
        failure_loss_s=failures * (interval / 2 + m.restart_s), wall_s=wall, goodput=ideal / wall,
        gpu_hours=gpu_hours, cost=None if m.gpu_hour_price is None else gpu_hours * m.gpu_hour_price,
        assumptions=assumptions)


YEAR_S = 365.25 * 86_400
# past this a duration says only that it is beyond reach: a huge goal (--tokens 1e18 on one GPU)
# would otherwise print a 30-digit number of days
MAX_SHOWN_YEARS = 1_000_000


def format_duration(seconds: float) -> str:
    """Seconds as people read a training time: '3.2 days', '5.1 h', '12 min', '40 s'; from two
    years on '7.4 years', '1,234 years', and past MAX_SHOWN_YEARS 'more than 1,000,000 years'."""
    if not seconds < MAX_SHOWN_YEARS * YEAR_S:  # inf and nan too
        return f"more than {MAX_SHOWN_YEARS:,} years"
    if seconds >= 2 * YEAR_S:
        years = seconds / YEAR_S
        return f"{years:,.0f} years" if years >= 100 else f"{years:.1f} years"
    if seconds >= 2 * 86_400:
        return f"{seconds / 86_400:.1f} days"
    if seconds >= 2 * 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 120:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s"


def describe(t: TimeToTrain, *, world_size: int) -> list[str]:
    """The time to train as the plan prints it: the answer, then each term, then assumptions."""
    lines = [f"time to train: {format_duration(t.wall_s)} on {world_size} GPU(s), "
             f"{t.gpu_hours:,.0f} GPU-hours"
             + (f", cost {t.cost:,.0f} at the given GPU-hour price" if t.cost is not None else "")
             + f"; goodput {t.goodput:.1%}",
             f"  training: {t.steps:,} steps x the predicted step = {format_duration(t.ideal_s)}",
             f"  checkpoints: one save takes {t.checkpoint_save_s:.0f} s, every "
             f"{format_duration(t.checkpoint_interval_s)} (Young/Daly), {format_duration(t.checkpoint_loss_s)} in all",
             f"  failures: {t.expected_failures:.1f} expected, each losing half an interval plus the "
             f"restart: {format_duration(t.failure_loss_s)} in all"]
    lines += [f"  assumption: {a}" for a in t.assumptions]
    return lines


def to_dict(t: TimeToTrain) -> dict[str, object]:
    """JSON-ready, with the days."""
    return {**dataclasses.asdict(t), "days": t.days}


__all__ = ["describe", "to_dict", "TrainGoal", "GoodputModel", "PlanRate", "TimeToTrain", "time_to_train", "goal_steps",
           "format_duration", "MTBF_GPU_HOURS", "CKPT_WRITE_GB_S_PER_NODE", "RESTART_S"]

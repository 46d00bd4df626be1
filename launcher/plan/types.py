"""What the planner predicts: memory and step time per candidate, and the chosen plan.

Frozen, keyword-only values (no torch, no I/O), made by `memory`, `cost` and `planner`.

Pure values: never imports torch or anything of dlaunch beyond `specs`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from launcher.errors import PlanError
from launcher.specs import GIB, Strategy


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Predicted peak memory of one rank, by term."""

    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    overhead_bytes: float  # CUDA context, allocator slack, DDP buckets, FSDP unsharded units
    assumptions: str = ""

    @property
    def total_bytes(self) -> float:
        """Sum of all terms."""
        return (self.params_bytes + self.grads_bytes + self.optimizer_bytes
                + self.activations_bytes + self.overhead_bytes)

    @property
    def total_gib(self) -> float:
        """Total in GiB."""
        return self.total_bytes / GIB


@dataclass(frozen=True, kw_only=True)
class StepTimeEstimate:
    """Predicted time of one optimizer step on one rank."""

    compute_s: float
    comm_total_s: float
    comm_exposed_s: float
    # compute lost to the communication hidden behind it (NCCL kernels take SMs and HBM)
    contention_s: float = 0.0
    # the expected wait for the slowest rank at each synchronisation
    sync_wait_s: float = 0.0
    # compute_s by kind of work: (("matmul", s), ("attention", s), ...); empty when not split
    compute_parts: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        for name in ("compute_s", "comm_total_s", "comm_exposed_s", "contention_s",
                     "sync_wait_s"):
            if getattr(self, name) < 0:
                raise PlanError(f"step time term {name} must be >= 0, got {getattr(self, name)}")

    @property
    def step_time_s(self) -> float:
        """Compute, the communication compute cannot hide, contention and the wait for the
        slowest rank."""
        return self.compute_s + self.comm_exposed_s + self.contention_s + self.sync_wait_s


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One point of the planner's search, fitting or not, with the reason it lost."""

    strategy: Strategy
    micro_batch: int
    grad_accum_steps: int
    memory: MemoryEstimate
    time: StepTimeEstimate
    fits: bool
    reason: str = ""


# what settled the plan's torch.compile: Dynamo's trace of the workload (proposed or declined),
# the user's flag, or a device the plan never proposes it on
COMPILE_DECIDERS = ("dynamo trace", "--compile", "--no-compile", "not traced", "cpu", "gpu too old")


@dataclass(frozen=True, kw_only=True)
class CompileDecision:
    """Whether the plan compiles the model, what decided it, and what it is predicted to gain."""

    compile: bool
    decided_by: str  # one of COMPILE_DECIDERS
    reason: str
    graph_breaks: int | None = None  # where the chosen strategy compiles; None: not traced
    first_break: str = ""
    eager_step_time_s: float | None = None
    compiled_step_time_s: float | None = None  # None: not modelled (CPU)
    basis: str = ""  # what the predicted gain rests on; empty when not priced

    def __post_init__(self) -> None:
        if self.decided_by not in COMPILE_DECIDERS:
            raise PlanError(f"compile decided_by must be one of {', '.join(COMPILE_DECIDERS)}, "
                            f"got {self.decided_by!r}")
        for name in ("graph_breaks", "eager_step_time_s", "compiled_step_time_s"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise PlanError(f"compile decision {name} must be >= 0, got {value}")


@dataclass(frozen=True, kw_only=True)
class Plan:
    """The planner's recommendation and why."""

    chosen: Candidate
    world_size: int
    num_nodes: int
    global_batch: int
    units_per_s: float
    scaling_efficiency: float
    env: Mapping[str, str]
    reasons: tuple[str, ...]
    rejected: tuple[Candidate, ...]
    usable_mem_bytes: float
    compile: CompileDecision | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return dataclasses.asdict(self)


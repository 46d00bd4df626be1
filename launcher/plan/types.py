"""What the planner predicts: memory and step time per candidate, and the chosen plan.

Frozen, keyword-only values (no torch, no I/O), made by `memory`, `cost` and `planner`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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

    @property
    def step_time_s(self) -> float:
        """Compute plus the communication backward cannot hide."""
        return self.compute_s + self.comm_exposed_s


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

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return dataclasses.asdict(self)


"""What the planner predicts: memory and step time per candidate, and the chosen plan; and the
user's decisions it keeps (`Overrides`). Frozen, keyword-only values made by `memory`, `cost` and
`planner`.

Pure values (no I/O): never imports torch or anything of dlaunch beyond `specs`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from launcher.errors import PlanError
from launcher.specs import (
    ATTENTION_KERNELS,
    DDP_KINDS,
    FLOAT8_RECIPES,
    FSDP_UNITS,
    GIB,
    LINEAR_UNITS_NEED,
    LOSS_KERNELS,
    NORM_KERNELS,
    REDUCE_DTYPES,
    Strategy,
    checkpointing_mode,
    linear_units_ok,
)

# the kernels the cost model prices for each role (`plan.kernels`), the first the default, and
# where a kernel the plan priced came from, first to last in precedence
KERNEL_ROLES: Mapping[str, tuple[str, ...]] = {"attention": ATTENTION_KERNELS, "loss": LOSS_KERNELS,
                                               "norm": NORM_KERNELS}
KERNEL_SOURCES = ("given", "declared", "detected", "default")


@dataclass(frozen=True, kw_only=True)
class PricedKernel:
    """A kernel the plan priced for one role (attention, loss, norm), and its source."""

    kernel: str
    source: str  # one of KERNEL_SOURCES

    def __post_init__(self) -> None:
        if self.source not in KERNEL_SOURCES:
            raise PlanError(f"kernel source must be one of {', '.join(KERNEL_SOURCES)}, got {self.source!r}")


@dataclass(frozen=True, kw_only=True)
class Overrides:
    """The decisions a user made, which the planner keeps (None: the planner's), and the kernels the
    run calls, which the planner prices (None: the workload's; `plan.kernels`)."""

    strategy: str | None = None
    precision: str | None = None
    micro_batch: int | None = None
    checkpointing: str | None = None  # a mode of CHECKPOINTING (old files' bool: full / none)
    compile: bool | None = None
    compile_mode: str | None = None
    tp: int | None = None
    offload: bool | None = None  # FSDP CPU offload (None: only where nothing else fits)
    float8: str | None = None  # one of FLOAT8_RECIPES (None: where predicted faster)
    reduce_dtype: str | None = None  # one of REDUCE_DTYPES (None: fp32)
    fsdp_unit: str | None = None  # one of FSDP_UNITS (None: block)
    attention_kernel: str | None = None  # one of ATTENTION_KERNELS
    loss_kernel: str | None = None  # one of LOSS_KERNELS
    norm_kernel: str | None = None  # one of NORM_KERNELS

    def __post_init__(self) -> None:
        tp, mb = self.tp, self.micro_batch
        if tp is not None and (not isinstance(tp, int) or isinstance(tp, bool) or tp < 1):
            raise PlanError(f"--tp (the tensor-parallel degree) must be an integer >= 1, got {tp!r}")
        if (tp or 1) > 1 and self.strategy in DDP_KINDS:
            raise PlanError(f"--tp {tp} composes tensor parallelism with FSDP on the data-parallel dimension; DDP does "
                            "not, nor does ZeRO-1: use --strategy fsdp_full or hybrid, or drop --tp")
        if mb is not None and (not isinstance(mb, int) or mb < 1):
            raise PlanError(f"--micro-batch must be an integer >= 1, got {mb!r}")
        if self.checkpointing is not None:
            object.__setattr__(self, "checkpointing", checkpointing_mode(self.checkpointing))
        # Strategy validates kind/precision/compile_mode with an actionable message
        Strategy(kind=self.strategy or "ddp", precision=self.precision or "fp32",
                 compile_mode=self.compile_mode or "default")
        if self.float8 not in (None, "none") and self.precision not in (None, "bf16"):
            raise PlanError(f"--float8 {self.float8} runs the linear layers' GEMMs in float8 and the rest in bf16; "
                            f"--precision {self.precision} does not: use --precision bf16 or drop --float8")
        if self.reduce_dtype not in (None, *REDUCE_DTYPES):
            raise PlanError(f"unknown --reduce-dtype {self.reduce_dtype!r}; use one of {', '.join(REDUCE_DTYPES)}")
        if self.reduce_dtype == "bf16" and self.precision not in (None, "bf16"):
            raise PlanError(f"--reduce-dtype bf16 reduces the gradients of a bf16 run in bf16; --precision "
                            f"{self.precision} is not: use --precision bf16 or --reduce-dtype fp32")
        if self.float8 not in (None, *FLOAT8_RECIPES):
            raise PlanError(f"unknown --float8 {self.float8!r}; use one of {', '.join(FLOAT8_RECIPES)}")
        if self.offload and self.strategy in DDP_KINDS:
            raise PlanError(f"--offload keeps FSDP's sharded state in host memory; --strategy "
                            f"{self.strategy} keeps whole parameters on the device: use "
                            "--strategy fsdp_full, fsdp_grad_op or hybrid, or drop --offload")
        if self.fsdp_unit not in (None, *FSDP_UNITS):
            raise PlanError(f"unknown --fsdp-unit {self.fsdp_unit!r}; use one of {', '.join(FSDP_UNITS)}")
        if self.fsdp_unit == "linear" and not linear_units_ok(strategy=self.strategy, tp=tp, compile=self.compile,
                                                                    checkpointing=self.checkpointing):
            raise PlanError(LINEAR_UNITS_NEED)
        for role, known in KERNEL_ROLES.items():
            value = getattr(self, f"{role}_kernel")
            if value is not None and value not in known:
                raise PlanError(f"unknown --{role}-kernel {value!r}; use one of {', '.join(known)}")

    @property
    def forced(self) -> tuple[tuple[str, Any], ...]:
        """The set decisions, (name, value) by name; empty when the planner decides all. The
        kernels and the reduce dtype are none: they change what a candidate costs, not which
        candidates there are."""
        return tuple(sorted((f.name, getattr(self, f.name)) for f in dataclasses.fields(self)
                            if getattr(self, f.name) is not None and not f.name.endswith("_kernel")
                            and f.name != "reduce_dtype"))


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Predicted peak memory of one rank, by term."""

    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    overhead_bytes: float  # CUDA context, allocator slack, DDP buckets, FSDP unsharded units
    assumptions: str = ""
    host_bytes: float = 0.0  # CPU offload: what the rank's shard keeps in host memory instead (not in the total)

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
    contention_s: float = 0.0  # compute lost to the communication hidden behind it (NCCL takes SMs and HBM)
    sync_wait_s: float = 0.0  # the expected wait for the slowest rank at each synchronisation
    compute_parts: tuple[tuple[str, float], ...] = ()  # compute_s by kind: (("matmul", s), ...); empty: not split

    def __post_init__(self) -> None:
        for name in ("compute_s", "comm_total_s", "comm_exposed_s", "contention_s", "sync_wait_s"):
            if getattr(self, name) < 0:
                raise PlanError(f"step time term {name} must be >= 0, got {getattr(self, name)}")

    def with_compute_scaled(self, factor: float) -> StepTimeEstimate:
        """This estimate with compute (and each part of it) times `factor`: a tune correction."""
        return dataclasses.replace(self, compute_s=self.compute_s * factor, compute_parts=tuple(
            (name, sec * factor) for name, sec in self.compute_parts))

    @property
    def step_time_s(self) -> float:
        """Compute, exposed communication, contention and the wait for the slowest rank."""
        return self.compute_s + self.comm_exposed_s + self.contention_s + self.sync_wait_s


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One point of the planner's search, fitting or not, with the reason it lost."""

    strategy: Strategy
    micro_batch: int
    grad_accum: int
    memory: MemoryEstimate
    time: StepTimeEstimate
    fits: bool
    reason: str = ""

    def with_compute_scaled(self, factor: float) -> Candidate:
        """This candidate with its predicted compute times `factor` (`StepTimeEstimate`'s)."""
        return dataclasses.replace(self, time=self.time.with_compute_scaled(factor))


# what settled the plan's torch.compile: Dynamo's trace of the workload (proposed or declined),
# the user's flag, or a device the plan never proposes it on
COMPILE_DECIDERS = ("dynamo trace", "--compile", "--no-compile", "not traced", "cpu", "gpu too old", "--fsdp-unit")


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
            raise PlanError(f"compile decided_by must be one of {', '.join(COMPILE_DECIDERS)}, got {self.decided_by!r}")
        for name in ("graph_breaks", "eager_step_time_s", "compiled_step_time_s"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise PlanError(f"compile decision {name} must be >= 0, got {value}")


@dataclass(frozen=True, kw_only=True)
class StepInterval:
    """An interval around a predicted step time, and what it rests on (`plan.interval`)."""

    step_time_s: float
    low_s: float
    high_s: float
    coverage: float
    basis: str

    def __post_init__(self) -> None:
        # a biased regime may put the point estimate outside its own interval: that is shown
        if not (0 < self.low_s <= self.high_s and self.step_time_s > 0 and 0 < self.coverage < 1):
            raise PlanError("an interval needs 0 < low <= high, a positive step and coverage in (0, 1); got "
                            f"{self.low_s!r}-{self.high_s!r} around {self.step_time_s!r}, {self.coverage!r}")

    def label(self) -> str:
        """'0.36-0.49 s, 80%'."""
        return f"{self.low_s:.3g}-{self.high_s:.3g} s, {self.coverage:.0%}"

    def around(self, step_time_s: float) -> StepInterval:
        """The same regime's interval around another step time (another candidate's)."""
        scale = step_time_s / self.step_time_s
        return dataclasses.replace(self, step_time_s=step_time_s, low_s=self.low_s * scale, high_s=self.high_s * scale)

    def rate_bounds(self, units_per_s: float) -> tuple[float, float]:
        """The throughput interval that goes with it: (low, high) units/s."""
        return units_per_s * self.step_time_s / self.high_s, units_per_s * self.step_time_s / self.low_s


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
    step_interval: StepInterval | None = None  # the 80% interval around the chosen step time
    # role (attention, loss, norm) -> the kernel priced and its source; empty: not recorded
    kernels: Mapping[str, PricedKernel] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return dataclasses.asdict(self)


"""RunRequest: what the user asked to run, completed by the plan, and the LaunchSpec it becomes.

The CLI merges flags and dlaunch.yaml into one RunRequest (`launcher.cli.prepare`); decisions
left open (None) are filled by the plan for the hardware the ranks will run on (`follow_plan`),
and only those: a decision the user made is passed to the planner as an override and kept.
Whatever is still open when nothing was planned (a plain script, a SLURM run without a topology
of its partition) takes `FALLBACKS`. Compile left open (None) is the plan's too: on for GPUs
where Dynamo traces the workload whole (`plan.compile_choice`), off when nothing was planned.
Messages name fields in backticks (`micro_batch`); the CLI turns them into its flags.

Must never import argparse or launcher.cli (no argv here), torch, or the code that runs a job.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from launcher.errors import PlanError, UsageError, WorkloadError
from launcher.plan.resolve import Planned, plan_workload, resolve_topology
from launcher.plan.search import label
from launcher.specs import (
    CHECKPOINTING,
    DEVICES,
    PRECISIONS,
    STRATEGIES,
    Goal,
    LaunchSpec,
    LoaderSpec,
    SlurmSpec,
    Strategy,
    check,
)

log = logging.getLogger(__name__)

# what nobody decided and nothing planned: a plain script, or a SLURM partition of unknown shape
FALLBACKS: Mapping[str, Any] = MappingProxyType(
    {"strategy": "ddp", "precision": "fp32", "micro_batch": 8, "grad_accum": 1, "checkpointing": "none",
     "tp": 1})
# when the user gave all three there is nothing left to plan (the plan is made for its prediction)
PLANNED_DECISIONS = ("strategy", "precision", "micro_batch")


@dataclass(frozen=True, kw_only=True)
class RunRequest:
    """One run (or each run of a lab, or the template of a sweep's points), as asked for."""

    workload: str  # absolute path of the workload file or plain script
    workload_args: tuple[str, ...] = ()
    is_script: bool = False
    device: str = "cpu"
    nodes: int = 1
    gpus: int = 1  # processes per node
    steps: int = 20
    warmup_steps: int | None = None  # None: min(3, steps - 1)
    # the decisions the plan makes when they are None
    strategy: str | None = None
    precision: str | None = None
    micro_batch: int | None = None
    grad_accum: int | None = None
    checkpointing: str | None = None  # one of launcher.specs.CHECKPOINTING; None: the plan's
    tp: int | None = None  # tensor-parallel degree inside a node; None: the plan's (1 unplanned)
    global_batch: int | None = None  # a goal for the plan; None: the plan's choice
    compile: bool | None = None  # None: the plan's (on for GPUs where Dynamo traces it whole)
    compile_mode: str = "default"
    compile_strict: bool = False
    shard_group_size: int = 0  # 0: the ranks of a node
    seed: int = 0
    log_every: int = 0
    max_grad_norm: float = 0.0
    calibrate: bool = True
    num_workers: int = 0
    profile: bool = False
    memory_snapshot: bool = False
    detect_anomaly: bool = False
    stop_on_nan: bool = False
    eval_every: int = 0
    hang_timeout_s: float = 300.0
    startup_timeout_s: float | None = None  # None: max(900, hang_timeout_s)
    max_restarts: int = 0
    checkpoint_every: int = 0
    slurm: SlurmSpec | None = None  # a SLURM job; None: this host
    planned: Planned | None = None  # the plan that filled the open decisions
    plan_note: str | None = None  # what to tell the user about the plan (or its absence)

    def __post_init__(self) -> None:
        check(self.device in DEVICES, UsageError, f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        for name in ("nodes", "gpus", "steps"):
            check(getattr(self, name) >= 1, UsageError, f"`{name}` must be >= 1, got {getattr(self, name)}")
        for name in ("micro_batch", "grad_accum", "global_batch"):
            value = getattr(self, name)
            check(value is None or value >= 1, UsageError, f"`{name}` must be >= 1, got {value}")
        # checked before planning, which profiles the workload: a typo should cost nothing
        check(self.warmup_steps is None or 0 <= self.warmup_steps < self.steps, UsageError,
              f"`warmup_steps` must be below `steps` ({self.steps}), got {self.warmup_steps}")
        check(self.strategy is None or self.strategy in STRATEGIES, UsageError,
              f"unknown strategy {self.strategy!r}; use one of {', '.join(STRATEGIES)}")
        check(self.precision is None or self.precision in PRECISIONS, UsageError,
              f"unknown precision {self.precision!r}; use one of {', '.join(PRECISIONS)}")
        check(self.checkpointing is None or self.checkpointing in CHECKPOINTING, UsageError,
              f"unknown checkpointing {self.checkpointing!r}; use one of {', '.join(CHECKPOINTING)}")
        check(self.tp is None or self.tp == 1 or (not self.is_script and self.strategy != "ddp"
                                                   and self.gpus % self.tp == 0), UsageError,
              f"`tp` {self.tp} splits each block over ranks of one node under FSDP: it needs a "
              f"workload (not a plain script), a strategy other than ddp and a divisor of the "
              f"processes per node ({self.gpus})")
        check(self.planned is None or not self.open_decisions, PlanError,
              f"a planned request leaves no decision open, got {', '.join(self.open_decisions)}")

    @property
    def open_decisions(self) -> tuple[str, ...]:
        """The plannable decisions still None, of strategy, precision, micro-batch."""
        return tuple(k for k in PLANNED_DECISIONS if getattr(self, k) is None)

    @property
    def world_size(self) -> int:
        """Total ranks."""
        return self.nodes * self.gpus

    @property
    def warmup(self) -> int:
        """Steps left out of throughput."""
        return self.warmup_steps if self.warmup_steps is not None else min(3, self.steps - 1)

    def decisions(self) -> dict[str, Any]:
        """strategy, precision, micro_batch, grad_accum, checkpointing, tp: as decided or planned,
        else `FALLBACKS`."""
        return {k: fallback if getattr(self, k) is None else getattr(self, k)
                for k, fallback in FALLBACKS.items()}

    def with_plan(self, planned: Planned) -> RunRequest:
        """This request with the plan's choice for each decision left open, and a note on it."""
        chosen = planned.plan.chosen
        choice: dict[str, Any] = {"strategy": chosen.strategy.kind, "precision": chosen.strategy.precision,
                  "micro_batch": chosen.micro_batch, "grad_accum": chosen.grad_accum_steps,
                  "checkpointing": chosen.strategy.checkpointing, "tp": chosen.strategy.tp}
        filled = {k: v for k, v in choice.items() if getattr(self, k) is None}
        if self.compile is None:
            filled["compile"] = chosen.strategy.compile
        warnings = [r for r in planned.plan.reasons if r.startswith("warning:")]
        compiled = " + torch.compile" if filled.get("compile") else ""
        note = (f"dlaunch: plan: {label(chosen)}{compiled}, micro-batch {chosen.micro_batch} x "
                f"{chosen.grad_accum_steps} accumulation, predicted {chosen.time.step_time_s:.3g} "
                f"s/step and {chosen.memory.total_gib:.2f} GiB/rank (`dlaunch plan` says why)")
        return dataclasses.replace(self, **filled, planned=planned,
                                   plan_note="\n".join([note, *(f"dlaunch: {w}" for w in warnings)]))

    def spec_fields(self) -> dict[str, Any]:
        """Every LaunchSpec field but `run_id` and `run_dir` (a sweep shares them over its points)."""
        d = self.decisions()
        return dict(
            workload=self.workload, workload_args=self.workload_args, is_script=self.is_script,
            device=self.device, num_nodes=self.nodes, nproc_per_node=self.gpus, steps=self.steps,
            warmup_steps=self.warmup, micro_batch=d["micro_batch"], grad_accum_steps=d["grad_accum"],
            seed=self.seed, log_every=self.log_every, calibrate_comm=self.calibrate,
            max_grad_norm=self.max_grad_norm, hang_timeout_s=self.hang_timeout_s,
            max_restarts=self.max_restarts, checkpoint_every=self.checkpoint_every,
            startup_timeout_s=(self.startup_timeout_s if self.startup_timeout_s is not None
                               else max(900.0, self.hang_timeout_s)),
            strategy=Strategy(kind=d["strategy"], precision=d["precision"],
                              checkpointing=d["checkpointing"], compile=bool(self.compile),
                              compile_mode=self.compile_mode, compile_strict=self.compile_strict,
                              tp=d["tp"]),
            loader=LoaderSpec(num_workers=self.num_workers), shard_group_size=self.shard_group_size,
            profile=self.profile, memory_snapshot=self.memory_snapshot,
            detect_anomaly=self.detect_anomaly, stop_on_nan=self.stop_on_nan,
            eval_every=self.eval_every)

    def launch_spec(self, *, run_id: str, run_dir: str) -> LaunchSpec:
        """The LaunchSpec of this request in `run_dir` (absolute); it validates everything."""
        return LaunchSpec(run_id=run_id, run_dir=run_dir, **self.spec_fields())


def follow_plan(request: RunRequest, *, topology: str | None = None) -> RunRequest:
    """Plan the request's open decisions for this machine, or for `topology` (a file: a SLURM
    partition's nodes, whose device must be the request's), shaped `nodes` x `gpus`.

    The user's decisions go to the planner as overrides: one predicted not to fit is warned
    about in the note, not refused. With every decision given, the plan is kept only for its
    prediction (the run sets it against what it measures): no note, and a plan that cannot be
    made leaves the request as it was. A plain script is returned unchanged.
    """
    if request.is_script:
        return request
    if not request.open_decisions:
        # what the run will do: the fallbacks of grad_accum and checkpointing too
        given = dataclasses.replace(request, **request.decisions())
        try:
            planned = _planned(given, topology)
        except (PlanError, WorkloadError) as e:  # the run goes ahead; its summary says why not
            log.debug("no prediction for the given decisions: %s", e)
            return request
        if request.compile is not None or not planned.plan.chosen.strategy.compile:
            return dataclasses.replace(request, planned=planned)  # compile None runs eagerly
        # the one decision left open was compile's, and the plan turns it on: say so
        return dataclasses.replace(request, planned=planned, compile=True, plan_note=(
            "dlaunch: plan: torch.compile on (`dlaunch plan` says why; --no-compile runs eagerly)"))
    return request.with_plan(_planned(request, topology))


def _planned(request: RunRequest, topology: str | None) -> Planned:
    """The plan of `request` with its given decisions as the planner's overrides."""
    topo = resolve_topology(topology=topology, gpus=request.gpus, nodes=request.nodes)
    if topology is not None and topo.device != request.device:
        raise UsageError(f"`topology` {topology} describes {topo.device} nodes but the partition's "
                         f"nodes are {request.device}; give a topology file of the partition's nodes")
    goal = request.global_batch
    if goal is None and request.micro_batch is not None and request.grad_accum is not None:
        goal = request.micro_batch * request.grad_accum * request.world_size
    overrides = {**{k: getattr(request, k) for k in PLANNED_DECISIONS if getattr(request, k) is not None},
                 "checkpointing": request.checkpointing, "compile": request.compile,
                 "tp": request.tp}
    return plan_workload(request.workload, request.workload_args, topo, Goal(global_batch=goal),
                         overrides=overrides)

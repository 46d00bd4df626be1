"""RunRequest: what the user asked to run, completed by the plan, and the LaunchSpec it becomes.

The CLI merges flags and dlaunch.yaml into one RunRequest (`launcher.cli.prepare`); decisions
left open (None) are filled by the plan for the hardware the ranks will run on (`follow_plan`),
and only those: a decision the user made goes to the planner as an override and is kept. What is
still open when nothing was planned takes each knob's fallback (compile too: the plan turns it on
where Dynamo traces the workload whole). Messages name fields in backticks (`micro_batch`).

Must never import argparse or launcher.cli (no argv here), torch, or the code that runs a job.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from launcher.errors import PlanError, UsageError, WorkloadError
from launcher.knobs import MAX_GLOBAL_BATCH, at_least
from launcher.plan.explain import label
from launcher.plan.kernels import given as given_kernels
from launcher.plan.resolve import Planned, plan_workload, resolve_topology
from launcher.plan.types import Overrides
from launcher.runspec import LaunchSpec, RunSettings
from launcher.specs import DEVICES, Goal, SlurmSpec, check, has_torchao

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class RunRequest(RunSettings):
    """One run (or each run of a lab, or the template of a sweep's points), as asked for: its
    knobs (`RunSettings`: the plan's decisions None until made) and where it runs."""

    workload: str  # absolute path of the workload file or plain script
    workload_args: tuple[str, ...] = ()
    is_script: bool = False
    device: str = "cpu"
    global_batch: int | None = None  # a goal for the plan (samples per optimizer step); None: its choice
    slurm: SlurmSpec | None = None  # a SLURM job; None: this host
    planned: Planned | None = None  # the plan that filled the open decisions
    plan_note: str | None = None  # what to tell the user about the plan (or its absence)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_warmup(is_script=self.is_script)
        check(self.device in DEVICES, UsageError, f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.global_batch is not None:
            at_least(1, MAX_GLOBAL_BATCH).validate("`global_batch`", self.global_batch)
        check(self.tp is None or self.tp == 1 or (not self.is_script and self.gpus % self.tp == 0), UsageError,
              f"`tp` {self.tp} splits each block over ranks of one node under FSDP: it needs a workload (not a "
              f"plain script), a strategy other than ddp and a divisor of the processes per node ({self.gpus})")
        check(self.planned is None or not self.open_decisions, PlanError,
              f"a planned request leaves no decision open, got {', '.join(self.open_decisions)}")

    @property
    def open_decisions(self) -> tuple[str, ...]:
        """Those of strategy, precision and micro-batch still None (none open: planned for its prediction only)."""
        return tuple(k for k in ("strategy", "precision", "micro_batch") if getattr(self, k) is None)

    def with_plan(self, planned: Planned) -> RunRequest:
        """This request with the plan's choice for each decision left open, and a note on it."""
        chosen, s = planned.plan.chosen, planned.plan.chosen.strategy
        choice: dict[str, Any] = {"strategy": s.kind, "precision": s.precision, "micro_batch": chosen.micro_batch,
                                  "grad_accum": chosen.grad_accum, "checkpointing": s.checkpointing, "tp": s.tp,
                                  "compile": s.compile, "offload": s.offload, "float8": s.float8,
                                  "fsdp_unit": s.fsdp_unit}
        filled = {k: v for k, v in choice.items() if getattr(self, k) is None}
        warnings = [r for r in planned.plan.reasons if r.startswith("warning:")]
        compiled = " + torch.compile" if filled.get("compile") else ""
        note = (f"dlaunch: plan: {label(chosen)}{compiled}, micro-batch {chosen.micro_batch} x "
                f"{chosen.grad_accum} accumulation, predicted {chosen.time.step_time_s:.3g} "
                f"s/step and {chosen.memory.total_gib:.2f} GiB/rank (`dlaunch plan` says why)")
        return dataclasses.replace(self, **filled, planned=planned,
                                   plan_note="\n".join([note, *(f"dlaunch: {w}" for w in warnings)]))

    def launch_spec(self, *, run_id: str, run_dir: str) -> LaunchSpec:
        """The LaunchSpec of this request in `run_dir` (absolute): validated, open decisions at their fallback."""
        return LaunchSpec(run_id=run_id, run_dir=run_dir, workload=self.workload, workload_args=self.workload_args,
                          is_script=self.is_script, device=self.device, **self.knob_values())


def follow_plan(request: RunRequest, *, topology: str | None = None) -> RunRequest:
    """Plan the request's open decisions for this machine, or for `topology` (a file: a SLURM
    partition's nodes, whose device must be the request's), shaped `nodes` x `gpus`. The user's
    decisions go to the planner as overrides: one predicted not to fit is warned about in the note,
    not refused. With every decision given, the plan is kept only for its prediction (no note; a
    plan that cannot be made leaves the request as it was). A plain script is returned unchanged."""
    if request.is_script:
        return request
    if not request.open_decisions:
        # what the run will do: the fallbacks of grad_accum and checkpointing too
        given = dataclasses.replace(request, **request.decided())
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


def point_plan(request: RunRequest, spec: LaunchSpec, *, topology: str | None = None) -> Planned | None:
    """The prediction for one point of a sweep of `request`: the plan at its shape with every decision
    given; None where the sweep was not planned or the point's plan cannot be made."""
    if request.planned is None:
        return None
    point = dataclasses.replace(
        request, planned=None, plan_note=None, gpus=spec.gpus, nodes=spec.nodes, global_batch=None,
        **{k: getattr(spec, k) for k in ("micro_batch", "grad_accum", "strategy", "precision",
                                         "checkpointing", "compile", "tp", "offload", "float8", "fsdp_unit")})
    return follow_plan(point, topology=topology).planned


def _planned(request: RunRequest, topology: str | None) -> Planned:
    """The plan of `request` with its given decisions as the planner's overrides."""
    topo = resolve_topology(topology=topology, gpus=request.gpus, nodes=request.nodes)
    if topology is not None and topo.device != request.device:
        raise UsageError(f"`topology` {topology} describes {topo.device} nodes but the partition's "
                         f"nodes are {request.device}; give a topology file of the partition's nodes")
    goal = request.global_batch
    if goal is None and request.micro_batch is not None and request.grad_accum is not None:
        goal = request.micro_batch * request.grad_accum * request.world_size
    overrides = Overrides(strategy=request.strategy, precision=request.precision,
                          micro_batch=request.micro_batch, checkpointing=request.checkpointing,
                          compile=request.compile, tp=request.tp, offload=request.offload,
                          # a run weighs float8 only where its ranks can convert (torchao)
                          float8=weighed_float8(request.float8), reduce_dtype=request.reduce_dtype,
                          fsdp_unit=request.fsdp_unit, **given_kernels(request))
    return plan_workload(request.workload, request.workload_args, topo, Goal(global_batch=goal), overrides=overrides)


def weighed_float8(given: str | None) -> str | None:
    """The float8 override a run plans with: the given recipe, else the plan's where torchao is installed."""
    return given if given is not None or has_torchao() else "none"

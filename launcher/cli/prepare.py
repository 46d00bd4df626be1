"""The preamble every launching command shares: parsed flags -> RunRequest -> a run dir.

The options arrive typed (`launcher.cli.options`); `placed` picks the backend (the one place
that does: `select` over launcher.backends.registry) and asks it where the ranks go;
`build_request` checks the workload, places the ranks, builds the RunRequest and lets the plan
fill what the user left open; `open_run` turns it into the LaunchSpec (every check passes
before anything is written) and creates the run dir with the plan beside it. `run`, `lab`,
`scale` and `tune` all go through here (`doctor` through `placed`). Must never import a command
module (they import this one), launcher.backends.slurm or torch.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

from launcher.backends.base import Ask, Backend, Placement, select
from launcher.backends.registry import BACKENDS
from launcher.cli.args import CPU_PROCESSES_PER_CORE
from launcher.cli.options import DoctorOptions, LabOptions, RunOptions, ScaleOptions, TuneOptions
from launcher.drivers.sweep import check_plan
from launcher.errors import PlanError, UsageError
from launcher.plan.explain import label, within_card
from launcher.plan.planfile import write_plan
from launcher.plan.time_to_train import format_duration
from launcher.request import RunRequest, follow_plan
from launcher.rundir import check_checkpoint_dir, checkpoint_dir, create_run_dir
from launcher.runspec import LaunchSpec
from launcher.specs import require_torchao
from launcher.workload import inspect_file

# the commands whose options build a RunRequest; `run` is a LabOptions with more
RequestOptions = LabOptions | ScaleOptions | TuneOptions
# a launch its own plan predicts past these is a typo (a global batch of 10^9 on one rank), not
# a run: refused without --force, before the run dir exists (`refuse_absurd`)
MAX_STEP_S = 86_400.0  # a day per optimizer step
MAX_RUN_S = 365 * 86_400.0  # a year for the run's steps


def _compile_choice(opts: RequestOptions) -> bool | None:
    """--compile (or --compile-mode / --compile-strict, which imply it): True; --no-compile:
    False; neither: None, the plan's decision."""
    given = opts.settings
    implied = [flag for flag, on in (("--compile-mode", given.compile_mode),
                                     ("--compile-strict", given.compile_strict)) if on]
    if given.compile is False and implied:
        raise UsageError(f"--no-compile contradicts {implied[0]}, which implies --compile; drop one")
    return True if implied else given.compile


def placed(opts: RequestOptions | DoctorOptions) -> tuple[Backend, Placement]:
    """The backend the flags pick (the one choice of it: SLURM with --slurm, else this host)
    and where it places the command's ranks."""
    flags = getattr(opts, "slurm", None)
    backend = select(BACKENDS, slurm=flags is not None)
    ask = Ask(command=opts.command, topology=getattr(opts, "topology", None), dry_run=opts.dry_run,
              per_core=CPU_PROCESSES_PER_CORE, slurm=flags)
    if isinstance(opts, ScaleOptions):
        return backend, backend.place(dataclasses.replace(ask, sizes=opts.gpus))
    if isinstance(opts, DoctorOptions):
        return backend, backend.place(dataclasses.replace(ask, gpus=opts.gpus, nodes=opts.nodes, force=opts.force))
    return backend, backend.place(dataclasses.replace(
        ask, gpus=opts.settings.gpus, nodes=opts.settings.nodes, force=opts.force,
        detach=isinstance(opts, RunOptions) and opts.detach))


def build_request(opts: RequestOptions, workload_args: Sequence[str]) -> tuple[RunRequest, Placement, Backend]:
    """The RunRequest of `run`, `lab`, `scale` or `tune` (for a sweep: its largest point),
    planned; where its ranks run, and the backend that runs them."""
    command = opts.command
    script = isinstance(opts, LabOptions) and opts.script
    if command == "lab" and isinstance(opts, LabOptions):
        compiled = _compile_choice(opts)
        for flag, given in (("--precision", opts.settings.precision),
                            ("--no-compile" if compiled is False else "--compile", compiled is not None),
                            ("--script", opts.script)):
            if given:
                raise UsageError(f"dlaunch lab chooses precision and compile itself; drop {flag}")
    kind = inspect_file(opts.workload, force_script=script)
    if kind.is_script and command == "lab":  # the lab runs dlaunch's harness, never a plain script
        raise UsageError(f"dlaunch lab needs a workload, and {opts.workload!r} is a plain script")
    if kind.is_script and isinstance(opts, ScaleOptions) and opts.mode == "strong":
        # each point runs the script with its own arguments: its batch per rank is its own
        raise UsageError(f"dlaunch scale --mode strong needs a workload file (the harness splits the global "
                         f"batch over each point's ranks); {opts.workload} is a plain script, which sets "
                         "its own batch per rank: use --mode weak")
    backend, place = placed(opts)
    kind.require_tp_plan(opts.settings.tp)
    require_torchao(opts.settings.float8 or "none")
    fields = {**opts.settings.knob_values(), "nodes": place.nodes, "gpus": place.gpus}
    if isinstance(opts, TuneOptions):
        # no steps given: a placeholder the warm-up fits in (cmd_tune sets the trial length)
        fields.update(warmup_steps=opts.warmup_steps, steps=opts.steps or (
            opts.warmup_steps + 1 if opts.warmup_steps is not None else fields["steps"]))
    else:
        fields["compile"] = _compile_choice(opts)
    if isinstance(opts, ScaleOptions):
        if opts.mode == "strong" and fields["grad_accum"] is None:
            fields["grad_accum"] = 1  # strong scaling splits --global-batch over the ranks only
        check_plan(opts.mode, [n for n, _, _ in place.shapes], global_batch=opts.global_batch,
                   micro_batch=opts.settings.decided()["micro_batch"], grad_accum=fields["grad_accum"] or 1)
    request = RunRequest(workload=str(kind.path), workload_args=tuple(workload_args), is_script=kind.is_script,
                         device=place.device, slurm=place.slurm, global_batch=opts.global_batch, **fields)
    if not place.here and place.topology is None:  # the login node is not the nodes to plan for
        return _not_planned(request), place, backend
    request = follow_plan(request, topology=place.topology)
    refuse_absurd(request, force=opts.force)
    return request, place, backend


def refuse_absurd(request: RunRequest, *, force: bool) -> None:
    """PlanError, in one line, for a launch its own plan predicts past its devices' memory, or
    will take more than MAX_STEP_S a step or MAX_RUN_S in all: the ranks would die or never
    finish, so say it now rather than after the run dir and torchrun. `force` launches anyway;
    the plan's milder warnings (a forced plan inside its headroom) stay warnings in its note."""
    if force or request.planned is None:
        return
    c, device = request.planned.plan.chosen, request.planned.topology.accelerator
    at = f"{label(c)} at micro-batch {c.micro_batch:,} x {c.grad_accum:,} accumulation"
    if not within_card(c, request.planned.topology):
        raise PlanError(f"the plan predicts {c.memory.total_gib:,.1f} GiB/rank for {at}, more than the "
                        f"{device.mem_gib:,.1f} GiB each has: the ranks would run out of memory; give a "
                        "smaller --micro-batch (or none: the plan picks one that fits) or more GPUs, or --force to "
                        "launch anyway")
    step = c.time.step_time_s
    if step > MAX_STEP_S or step * request.steps > MAX_RUN_S:
        shown = f"{step:,.0f}" if step >= 100 else f"{step:.3g}"
        raise PlanError(f"the plan predicts {shown} s/step for {at}: {request.steps:,} steps take "
                        f"{format_duration(step * request.steps)} (the bounds: a day per step, a year per run); "
                        "give a smaller --global-batch, --micro-batch or --steps, or --force to launch anyway")


def _not_planned(request: RunRequest) -> RunRequest:
    """A SLURM run without a topology of its partition: the login node would be the wrong
    machine to plan for, so the open decisions take the fallbacks and the note says so."""
    if request.is_script or not request.open_decisions:
        return request
    fallback = ", ".join(f"{k.replace('_', '-')} {request.decided()[k]}" for k in request.open_decisions)
    return dataclasses.replace(request, plan_note="dlaunch: not planned: no --topology for the partition's nodes "
                                                  f"(or slurm.topology in dlaunch.yaml); using {fallback}")


def open_run(request: RunRequest, *, run_id: str, run_dir: str | None, dry_run: bool,
             keep_plan: bool = True) -> LaunchSpec:
    """The request's LaunchSpec in `run_dir` (default runs/<run_id>), validated; unless this is
    a dry run, the run dir is created then, with the plan beside it when `keep_plan`."""
    path = Path(run_dir if run_dir is not None else Path("runs") / run_id).expanduser().absolute()
    spec = request.launch_spec(run_id=run_id, run_dir=str(path))  # bad input writes nothing
    if spec.checkpoint_every > 0 or spec.max_restarts > 0:
        check_checkpoint_dir(checkpoint_dir(path, os.environ))
    if not dry_run:
        create_run_dir(run_dir, run_id)
        if keep_plan and request.planned is not None:
            write_plan(path, request.planned)
    return spec

"""The preamble every launching command shares: parsed flags -> RunRequest -> a run dir.

The options arrive typed (`launcher.cli.options`: flags > dlaunch.yaml > defaults, the yaml
only for SLURM runs, whose defaults it holds); `build_request` checks the workload, places the
ranks, builds the RunRequest and lets the plan fill what the user left open; `open_run` turns
it into the LaunchSpec (every check passes before anything is written) and creates the run dir
with the plan beside it.
`run`, `run --slurm`, `lab`, `scale` and `tune` all go through here; `--plan FILE` fills the
decisions its flags left open from a plan file.

Must never import a command module (they import this one) or torch.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from launcher.cli.options import LabOptions, RunOptions, ScaleOptions, TuneOptions
from launcher.cli.placement import (
    Placement,
    local_placement,
    local_sweep_placement,
    slurm_placement,
    slurm_sweep_placement,
)
from launcher.errors import UsageError
from launcher.files import atomic_write_json
from launcher.jobs.sweep import check_plan
from launcher.plan.resolve import Planned
from launcher.request import FALLBACKS, RunRequest, follow_plan
from launcher.rundir import RunPaths, check_checkpoint_dir, checkpoint_dir, create_run_dir
from launcher.specs import LaunchSpec
from launcher.workload import inspect_file

log = logging.getLogger(__name__)

# commands that run dlaunch's harness and so cannot take a plain torchrun script
_NEEDS_WORKLOAD = {
    "lab": "dlaunch lab needs a workload, and {given!r} is a plain script",
    "scale": "dlaunch scale needs a workload file (the harness sets each point's batch); {given} "
             "is a plain script",
}
# option dests the placement decides, not the flags directly
_PLACED = ("workload", "gpus", "nodes", "slurm")
_FROM_OPTIONS = tuple(f.name for f in dataclasses.fields(RunRequest) if f.name not in _PLACED)


# the commands whose options build a RunRequest; `run` is a LabOptions with more
RequestOptions = LabOptions | ScaleOptions | TuneOptions


def _compile_choice(opts: RequestOptions) -> bool | None:
    """--compile (or --compile-mode / --compile-strict, which imply it): True; --no-compile:
    False; neither: None, the plan's decision."""
    if isinstance(opts, TuneOptions):
        return None  # tune has no compile flags: each trial's candidate says
    implied: list[str] = []
    if isinstance(opts, LabOptions):  # scale has --compile but not the flags that imply it
        implied = [flag for flag, given in (("--compile-mode", opts.compile_mode),
                                            ("--compile-strict", opts.compile_strict)) if given]
    if opts.compile is False and implied:
        raise UsageError(f"--no-compile contradicts {implied[0]}, which implies --compile; drop one")
    return True if implied else opts.compile


def _place(opts: RequestOptions) -> Placement:
    """Where the request's ranks run: SLURM nodes with --slurm, else this host."""
    if isinstance(opts, ScaleOptions):
        if opts.slurm is not None:
            return slurm_sweep_placement(opts.slurm, sizes=opts.gpus, topology=opts.topology,
                                         dry_run=opts.dry_run)
        return local_sweep_placement(opts.gpus)
    if isinstance(opts, (RunOptions, TuneOptions)) and opts.slurm is not None:
        return slurm_placement(opts.command, opts.slurm, gpus=opts.gpus, nodes=opts.nodes, topology=opts.topology,
                               dry_run=opts.dry_run, detach=isinstance(opts, RunOptions) and opts.detach)
    return local_placement(gpus=opts.gpus, force=opts.force)


def _request_fields(opts: RequestOptions) -> dict[str, Any]:
    """The options that are RunRequest fields of the same name, where given (or defaulted)."""
    declared = {f.name for f in dataclasses.fields(opts)}
    return {k: getattr(opts, k) for k in _FROM_OPTIONS if k in declared and getattr(opts, k) is not None}


def build_request(opts: RequestOptions, workload_args: Sequence[str]) -> tuple[RunRequest, Placement]:
    """The RunRequest of `run`, `lab`, `scale` or `tune` (for a sweep: its largest point), planned."""
    command = opts.command
    script = isinstance(opts, LabOptions) and opts.script
    if command == "lab" and isinstance(opts, LabOptions):
        compiled = _compile_choice(opts)
        for flag, given in (("--precision", opts.precision),
                            ("--no-compile" if compiled is False else "--compile", compiled is not None),
                            ("--script", opts.script)):
            if given:
                raise UsageError(f"dlaunch lab chooses precision and compile itself; drop {flag}")
    kind = inspect_file(opts.workload, force_script=script)
    if kind.is_script and command in _NEEDS_WORKLOAD:
        raise UsageError(_NEEDS_WORKLOAD[command].format(given=opts.workload))
    place = _place(opts)
    fields = _request_fields(opts)
    kind.require_tp_plan(fields.get("tp"))
    fields.update(compile=_compile_choice(opts),
                  calibrate=not (isinstance(opts, LabOptions) and opts.no_calibrate))
    if command == "tune" and "steps" not in fields and "warmup_steps" in fields:
        # a placeholder the warm-up fits in: cmd_tune sets the trial length from the candidates
        fields["steps"] = fields["warmup_steps"] + 1
    if isinstance(opts, ScaleOptions):
        if opts.mode == "strong" and opts.grad_accum is None:
            fields["grad_accum"] = 1  # strong scaling splits --global-batch over the ranks only
        check_plan(opts.mode, place.world_sizes, global_batch=opts.global_batch,
                   micro_batch=opts.micro_batch or FALLBACKS["micro_batch"],
                   grad_accum=fields.get("grad_accum", 1))
    request = RunRequest(workload=str(kind.path), workload_args=tuple(workload_args),
                         is_script=kind.is_script, device=place.device, nodes=place.nodes,
                         gpus=place.gpus, slurm=place.slurm, **fields)
    if place.slurm is not None and place.topology is None:
        return _not_planned(request), place
    return follow_plan(request, topology=place.topology), place


def _not_planned(request: RunRequest) -> RunRequest:
    """A SLURM run without a topology of its partition: the login node would be the wrong
    machine to plan for, so the open decisions take the fallbacks and the note says so."""
    if request.is_script or not request.open_decisions:
        return request
    fallback = ", ".join(f"{k.replace('_', '-')} {FALLBACKS[k]}" for k in request.open_decisions)
    return dataclasses.replace(request, plan_note=(
        "dlaunch: not planned: no --topology for the partition's nodes (or slurm.topology in "
        f"dlaunch.yaml); using {fallback}"))


def write_plan(run_dir: str | Path, planned: Planned) -> None:
    """Keep the plan beside the run, so reports can set predicted against measured."""
    atomic_write_json(RunPaths(root=Path(run_dir)).plan, {
        "plan": planned.plan.to_dict(), "profile": dataclasses.asdict(planned.profile),
        "topology": planned.topology.name})


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

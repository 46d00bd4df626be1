"""The preamble every launching command shares: parsed flags -> RunRequest -> a run dir.

`options` merges flags > dlaunch.yaml > defaults (the yaml only for SLURM runs, whose defaults
it holds); `build_request` checks the workload, places the ranks, builds the RunRequest and
lets the plan fill what the user left open; `open_run` turns it into the LaunchSpec (every
check passes before anything is written) and creates the run dir with the plan beside it.
`run`, `run --slurm`, `lab`, `scale` and `tune` all go through here; `--plan FILE` fills the
decisions its flags left open from a plan file.

Must never import a command module (they import this one) or torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from launcher.cli.args import resolve
from launcher.cli.config import load_config
from launcher.cli.placement import Placement, local_placement, slurm_placement
from launcher.errors import UsageError
from launcher.files import atomic_write_json
from launcher.jobs.sweep import check_plan
from launcher.jobs.tune import read_plan_file
from launcher.plan.resolve import Planned
from launcher.request import FALLBACKS, RunRequest, follow_plan
from launcher.rundir import RunPaths, create_run_dir
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


def options(command: str, args: argparse.Namespace) -> dict[str, Any]:
    """`command`'s options: flag > dlaunch.yaml (read for --slurm only) > default."""
    configured = load_config().values if getattr(args, "slurm", None) else {}
    values = resolve(command, args, configured)
    if values.get("plan"):
        values.update(_from_plan_file(values))
    return values


def _from_plan_file(values: Mapping[str, Any]) -> dict[str, Any]:
    """`--plan FILE`'s decisions for those the flags left open (a flag given beside it wins)."""
    decided = read_plan_file(values["plan"])
    out = {k: v for k, v in decided.items() if k != "compile" and values.get(k) is None}
    out["compile"] = bool(decided["compile"]) if values.get("compile") is None else values["compile"]
    return out


def _compile_choice(values: Mapping[str, Any]) -> bool | None:
    """--compile (or --compile-mode / --compile-strict, which imply it): True; --no-compile:
    False; neither: None, the plan's decision."""
    implied = [flag for flag, dest in (("--compile-mode", "compile_mode"),
                                       ("--compile-strict", "compile_strict")) if values.get(dest)]
    if values.get("compile") is False and implied:
        raise UsageError(f"--no-compile contradicts {implied[0]}, which implies --compile; drop one")
    return True if implied else values.get("compile")


def build_request(command: str, values: Mapping[str, Any], workload_args: Sequence[str]
                  ) -> tuple[RunRequest, Placement]:
    """The RunRequest of `run`, `lab` or `scale` (for a sweep: its largest point), planned."""
    if command == "lab":
        compiled = _compile_choice(values)
        for flag, given in (("--precision", values["precision"]),
                            ("--no-compile" if compiled is False else "--compile", compiled is not None),
                            ("--script", values["script"])):
            if given:
                raise UsageError(f"dlaunch lab chooses precision and compile itself; drop {flag}")
    kind = inspect_file(values["workload"], force_script=bool(values.get("script")))
    if kind.is_script and command in _NEEDS_WORKLOAD:
        raise UsageError(_NEEDS_WORKLOAD[command].format(given=values["workload"]))
    place = slurm_placement(command, values) if values.get("slurm") else local_placement(command, values)
    fields: dict[str, Any] = {k: values[k] for k in _FROM_OPTIONS if values.get(k) is not None}
    fields.update(compile=_compile_choice(values), calibrate=not values.get("no_calibrate"))
    if command == "tune" and "steps" not in fields and "warmup_steps" in fields:
        # a placeholder the warm-up fits in: cmd_tune sets the trial length from the candidates
        fields["steps"] = fields["warmup_steps"] + 1
    if command == "scale":
        if values["mode"] == "strong" and values["grad_accum"] is None:
            fields["grad_accum"] = 1  # strong scaling splits --global-batch over the ranks only
        check_plan(values["mode"], place.world_sizes, global_batch=values["global_batch"],
                   micro_batch=values["micro_batch"] or FALLBACKS["micro_batch"],
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
    if not dry_run:
        create_run_dir(run_dir, run_id)
        if keep_plan and request.planned is not None:
            write_plan(path, request.planned)
    return spec

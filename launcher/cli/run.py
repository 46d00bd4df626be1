"""`dlaunch run`: one run on this host (torchrun) or on SLURM nodes (`--slurm`), or its dry run.

Flags -> RunRequest -> LaunchSpec through `launcher.cli.prepare`, then the local or the SLURM
job follower. Must never import torch or launcher.runtime.
"""

from __future__ import annotations

import argparse
import logging
import sys

from launcher.backends import local
from launcher.backends.slurm import submit
from launcher.cli.prepare import build_request, open_run, options
from launcher.jobs.local import dry_run_text, run_local
from launcher.jobs.slurm import run_slurm
from launcher.request import RunRequest
from launcher.results.types import RunResult
from launcher.rundir import new_run_id
from launcher.specs import LaunchSpec

log = logging.getLogger(__name__)


def note(text: str | None) -> None:
    """Print the plan's note (or why there is no plan) to stderr, if there is one."""
    if text:
        print(text, file=sys.stderr)


def exit_status(result: RunResult) -> int:
    """The exit code of a finished run: torchrun's when it failed, else 1 unless status ok."""
    return result.exit_code if result.exit_code != 0 else (0 if result.status == "ok" else 1)


def cmd_run(args: argparse.Namespace, workload_args: list[str]) -> int:
    """`dlaunch run`: launch and summarise."""
    values = options("run", args)
    request, _ = build_request("run", values, workload_args)
    spec = open_run(request, run_id=new_run_id(values["workload"]), run_dir=values["run_dir"],
                    dry_run=values["dry_run"])
    if request.slurm is not None:
        return _on_slurm(request, spec, dry_run=values["dry_run"], as_json=values["json"])
    if values["dry_run"]:
        note(request.plan_note)
        print(dry_run_text(spec, local.render(spec)), end="")
        return 0
    if spec.device == "cpu":
        print(f"dlaunch: no CUDA GPU on this machine; running {spec.nproc_per_node} CPU process(es) "
              "with gloo", file=sys.stderr)
    note(request.plan_note)
    return exit_status(run_local(spec, as_json=values["json"], debug=bool(args.debug)))


def _on_slurm(request: RunRequest, spec: LaunchSpec, *, dry_run: bool, as_json: bool) -> int:
    """`dlaunch run --slurm`: print the sbatch script, or submit (and follow, unless detached)."""
    assert request.slurm is not None
    if dry_run:
        note(request.plan_note)
        print(submit.dry_run_text(spec, request.slurm, submit.render(spec, request.slurm)), end="")
        return 0
    result = run_slurm(spec, request.slurm, as_json=as_json, out=sys.stdout, note=request.plan_note)
    return 0 if result is None else exit_status(result)  # None: detached

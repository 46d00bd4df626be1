"""`dlaunch status | logs | cancel RUN_DIR_OR_JOB`, for a run of any backend.

The commands ask each backend of the registry (launcher.backends.registry) in turn whether the
run is its own (`owner_of`): a run dir with the `slurm.json` that `run --slurm` wrote, or a bare
SLURM job id, is SLURM's; any other run dir is a local run (`owner.json` names its dlaunch). A
detached run gets its result.json (and the usual summary) the first time `status` sees it over
(`launcher.drivers.launch.status`). Must never import torch or launcher.backends.slurm.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import IO

from launcher.backends.base import Registry, owner_of
from launcher.backends.registry import BACKENDS
from launcher.cli.options import CancelOptions, LogsOptions, StatusOptions, load
from launcher.drivers.launch import status as settled_status


def status(ref: str, *, as_json: bool = False, out: IO[str] = sys.stdout, registry: Registry = BACKENDS) -> int:
    """Print the run's state, its progress and, once it is over, the run summary."""
    found = settled_status(owner_of(registry, ref), ref)
    out.write(json.dumps(dict(found.data), indent=2) + "\n" if as_json else found.text + "\n")
    return 0


def logs(ref: str, *, rank: int | None = None, follow: bool = False,
         out: IO[str] = sys.stdout, registry: Registry = BACKENDS) -> int:
    """Print the run's rank logs (every rank's, or one's); `follow` until the run is over."""
    owner_of(registry, ref).logs(ref, out=out, rank=rank, follow=follow)
    return 0


def cancel(ref: str, *, out: IO[str] = sys.stdout, registry: Registry = BACKENDS) -> int:
    """Stop the run (a finished one is left alone, and says so) and say what was done."""
    out.write(owner_of(registry, ref).cancel(ref).message + "\n")
    return 0


def cmd_status(args: argparse.Namespace, workload_args: list[str]) -> int:
    """`dlaunch status RUN_DIR_OR_JOB`: a run's state, progress and summary."""
    opts = load(StatusOptions, args)
    return status(opts.job, as_json=opts.json)


def cmd_logs(args: argparse.Namespace, workload_args: list[str]) -> int:
    """`dlaunch logs RUN_DIR_OR_JOB [--rank R] [--follow]`."""
    opts = load(LogsOptions, args)
    return logs(opts.job, rank=opts.rank, follow=opts.follow)


def cmd_cancel(args: argparse.Namespace, workload_args: list[str]) -> int:
    """`dlaunch cancel RUN_DIR_OR_JOB`: stop a run and wait until it has stopped."""
    return cancel(load(CancelOptions, args).job)

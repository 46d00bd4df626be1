"""The `--slurm` half of `dlaunch run`: its flags, argv -> SlurmSpec, and the run itself.

`cli.py` adds these flags to `run` and hands over when `--slurm` is given, so the SLURM code
stays out of the local path. Precedence: command line > dlaunch.yaml (slurm section) > what
SLURM says (sinfo: CPUs per node, GPUs in the partition) > built-in defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from typing import Any

from launcher.cli.args import int_at_least
from launcher.errors import UsageError

log = logging.getLogger(__name__)

# flags that mean nothing without --slurm: (dest, flag, value when not given)
# (`dlaunch scale` has no --nodes/--detach, and its own --topology: see SWEEP_OMITS)
_SLURM_ONLY = (("nodes", "--nodes", None), ("gpus_per_node", "--gpus-per-node", None),
               ("partition", "--partition", None), ("account", "--account", None),
               ("qos", "--qos", None), ("constraint", "--constraint", None),
               ("time_min", "--time-min", None), ("cpus_per_node", "--cpus-per-node", None),
               ("slurm_opt", "--slurm-opt", None), ("queue_timeout_min", "--queue-timeout-min", None),
               ("detach", "--detach", False), ("topology", "--topology", None))


def _minutes(flag: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise UsageError(f"{flag} must be a number of minutes > 0 (fractions allowed), got {text!r}") from None
        if not (value > 0 and math.isfinite(value)):
            raise UsageError(f"{flag} must be a number of minutes > 0, got {text}")
        return value

    return parse


# the run flags a sweep does without: a point's nodes follow from its world size, a sweep
# follows every job, and `dlaunch scale --topology` also serves local sweeps
SWEEP_OMITS = ("nodes", "detach", "topology")


def add_slurm_args(p: argparse.ArgumentParser, *, sweep: bool = False) -> None:
    """The SLURM flags of `dlaunch run` (see `dlaunch run --help`), or with `sweep` those of
    `dlaunch scale --slurm` (no --nodes, --detach or --topology)."""
    g = p.add_argument_group("SLURM (with --slurm; defaults from dlaunch.yaml's slurm: section)")
    g.add_argument("--slurm", action="store_true",
                   help="run each point as a SLURM job (one per world size and repeat)" if sweep else
                   "submit to SLURM (submitit): one task per node, each running torchrun")
    if not sweep:
        g.add_argument("--nodes", type=int_at_least("--nodes", 1), default=None, help="nodes (default 1)")
    g.add_argument("--gpus-per-node", type=int_at_least("--gpus-per-node", 1), default=None,
                   help="processes (GPUs) per node: a point of N ranks runs on N / this many nodes "
                        "(default: the partition's GPUs per node, or CPUs per node without GPUs)"
                   if sweep else "processes (GPUs) per node; same as --gpus")
    g.add_argument("--partition", default=None, help="SLURM partition (default: the cluster's default)")
    g.add_argument("--account", default=None)
    g.add_argument("--qos", default=None)
    g.add_argument("--constraint", default=None, help="node features, e.g. a100")
    g.add_argument("--time-min", type=_minutes("--time-min"), default=None,
                   help="job time limit in minutes (default 60)")
    g.add_argument("--cpus-per-node", type=int_at_least("--cpus-per-node", 1), default=None,
                   help="CPUs to request per node (default: the partition's CPUs per node)")
    g.add_argument("--slurm-opt", action="append", default=None, metavar="KEY=VALUE",
                   help="extra sbatch option, e.g. --slurm-opt mem=64G (repeatable)")
    g.add_argument("--queue-timeout-min", type=_minutes("--queue-timeout-min"), default=None,
                   help="cancel the job if it is still pending after this many minutes")
    if sweep:
        return
    g.add_argument("--detach", action="store_true",
                   help="print the job id and run dir and return (see dlaunch status/logs/cancel)")
    g.add_argument("--topology", default=None, metavar="FILE",
                   help="the partition's nodes (topologies/*.yaml) for the plan; without it a SLURM "
                        "run is not planned (this login node says nothing about the compute nodes)")


def reject_without_slurm(args: argparse.Namespace, *, sweep: bool = False) -> None:
    """A SLURM flag given to a local run (or sweep) is a mistake worth one line."""
    for dest, flag, unset in _SLURM_ONLY:
        if sweep and dest in SWEEP_OMITS:
            continue
        if getattr(args, dest, unset) not in (unset,):
            raise UsageError(f"{flag} needs --slurm (a local run uses this machine only)")


def slurm_spec_from_args(args: argparse.Namespace) -> Any:
    """SlurmSpec from the flags, dlaunch.yaml and sinfo."""
    from launcher.backends.slurm.jobs import partition_shape
    from launcher.backends.slurm.submit import DEFAULT_TIME_MIN, SlurmSpec, parse_slurm_opts
    from launcher.config import load_config

    cfg = load_config().slurm
    partition = args.partition or cfg.partition
    cpus = args.cpus_per_node or cfg.cpus_per_node
    if cpus is None and shutil.which("sinfo"):
        cpus = partition_shape(partition)[0]
    return SlurmSpec(
        partition=partition, account=args.account or cfg.account, qos=args.qos or cfg.qos,
        constraint=args.constraint or cfg.constraint,
        time_min=args.time_min or cfg.time_min or DEFAULT_TIME_MIN,
        opts=parse_slurm_opts(args.slurm_opt or [], cfg.opts),
        cpus_per_node=cpus,
        queue_timeout_min=args.queue_timeout_min or cfg.queue_timeout_min,
        detach=getattr(args, "detach", False),
    )


def sweep_backend(args: argparse.Namespace) -> tuple[str, int, Callable[..., Any]]:
    """For `dlaunch scale --slurm`: (device, processes per node, a sweep `launch_point` that
    runs each point as one SLURM job and follows it like `run --slurm`)."""
    from launcher.backends.slurm import submit as backend
    from launcher.backends.slurm.jobs import partition_shape

    slurm = slurm_spec_from_args(args)
    if not args.dry_run:
        backend.check_slurm_available()
    device = _device(args, slurm.partition)
    per_node = args.gpus_per_node
    if per_node is None and shutil.which("sinfo"):
        cpus, gpus = partition_shape(slurm.partition)
        per_node = gpus if device == "cuda" else (slurm.cpus_per_node or cpus)
    if not per_node:
        raise UsageError("dlaunch scale --slurm: give --gpus-per-node (processes per node); "
                         "sinfo could not tell how many the partition's nodes have")

    def launch_point(spec: Any, console: Any) -> Any:
        from launcher.jobs.slurm import run_slurm

        return run_slurm(spec, slurm, out=console)

    return device, per_node, launch_point


def _device(args: argparse.Namespace, partition: str | None) -> str:
    """cuda when the partition's nodes have GPUs (sinfo GRES), else cpu; the login node's own
    hardware says nothing about the compute nodes."""
    from launcher.backends.slurm.jobs import partition_shape

    if shutil.which("sinfo"):
        return "cuda" if partition_shape(partition)[1] else "cpu"
    return "cuda" if args.gpus_per_node else "cpu"


def _plan_for_partition(args: argparse.Namespace, workload_args: Sequence[str], nodes: int,
                        device: str) -> str | None:
    """Plan from the partition's topology (--topology or dlaunch.yaml); a note to print.

    Without a topology the open decisions fall back to RUN_FALLBACKS and the note says so: the
    login node's hardware would be the wrong machine to plan for.
    """
    from launcher.cli.run import RUN_FALLBACKS, follow_plan
    from launcher.config import load_config

    topology = args.topology or load_config().slurm.topology
    if topology is None:
        open_ = [k for k in ("strategy", "precision", "micro_batch") if getattr(args, k) is None]
        if not open_:
            return None
        fallback = ", ".join(f"{k.replace('_', '-')} {RUN_FALLBACKS[k]}" for k in open_)
        return (f"dlaunch: not planned: no --topology for the partition's nodes (or slurm.topology "
                f"in dlaunch.yaml); using {fallback}")
    return follow_plan(args, workload_args, topology=topology, nodes=nodes, device=device)


def run_from_args(args: argparse.Namespace, workload_args: Sequence[str]) -> int:
    """`dlaunch run --slurm ...`: validate, then dry-run, detach or submit-and-follow."""
    from launcher.backends.slurm import submit as backend
    from launcher.cli.run import launch_spec_from_args, write_plan
    from launcher.rundir import create_run_dir, new_run_id
    from launcher.workload import inspect_file

    kind = inspect_file(args.workload, force_script=args.script)
    args.workload_path = str(kind.path)
    if args.warmup_steps is not None and args.warmup_steps >= args.steps:
        raise UsageError(f"--warmup-steps must be below --steps ({args.steps}), got {args.warmup_steps}")
    if args.gpus_per_node and args.gpus not in (1, args.gpus_per_node):
        raise UsageError(f"--gpus {args.gpus} and --gpus-per-node {args.gpus_per_node} disagree; give one")
    if args.gpus_per_node:
        args.gpus = args.gpus_per_node
    nodes = args.nodes or 1
    slurm = slurm_spec_from_args(args)  # bad flags/config fail before anything runs
    if not args.dry_run:
        backend.check_slurm_available()
    device = _device(args, slurm.partition)
    plan_note = None if kind.is_script else _plan_for_partition(args, workload_args, nodes, device)
    run_id = new_run_id(args.workload)

    def spec_for(run_dir: str) -> Any:
        spec = launch_spec_from_args(args, workload_args, device=device, run_dir=run_dir,
                                     run_id=run_id, is_script=kind.is_script)
        return dataclasses.replace(spec, num_nodes=nodes)

    if args.dry_run:
        if plan_note:
            print(plan_note, file=sys.stderr)
        spec = spec_for(os.path.abspath(args.run_dir or os.path.join("runs", run_id)))
        print(backend.dry_run_text(spec, slurm, backend.render(spec, slurm)), end="")
        return 0
    spec_for("/nonexistent")  # validate before creating the run dir
    spec = spec_for(str(create_run_dir(args.run_dir, run_id)))
    if getattr(args, "planned", None) is not None:
        write_plan(spec.run_dir, args.planned)
    from launcher.jobs.slurm import run_slurm

    result = run_slurm(spec, slurm, as_json=args.json, out=sys.stdout, note=plan_note)
    if result is None:  # detached
        return 0
    return result.exit_code if result.exit_code != 0 else (0 if result.status == "ok" else 1)

"""Where the ranks of `run`, `lab`, `scale` or `tune` will run: this host, or nodes of a SLURM partition.

On this host the device is what it has (GPUs, else CPU processes). On SLURM the partition's
nodes decide, never the login node dlaunch starts on: the device from sinfo's GRES, the plan
from a topology file of the partition (--topology or dlaunch.yaml), and the SlurmSpec from
flags > dlaunch.yaml > sinfo > defaults (merged by `launcher.cli.args.resolve`).

Must never import a command module or launcher.cli.prepare (which imports this one).
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass

from launcher.backends.slurm.jobs import partition_shape
from launcher.backends.slurm.submit import SlurmSpec, check_slurm_available
from launcher.cli.args import CPU_PROCESSES_PER_CORE
from launcher.cli.options import SlurmOptions
from launcher.errors import UsageError
from launcher.hardware.detect import usable_cores
from launcher.hardware.gpu_probe import count_gpus
from launcher.jobs.sweep import parse_world_sizes, point_shape

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Placement:
    """The hardware a request runs on; for a sweep, its largest point (which the plan is for)."""

    device: str
    nodes: int = 1
    gpus: int = 1  # processes per node
    slurm: SlurmSpec | None = None  # None: this host
    topology: str | None = None  # SLURM: a topology file of the partition's nodes, for the plan
    world_sizes: tuple[int, ...] = ()  # `scale`: every point's ranks, ascending
    per_node: int | None = None  # `scale --slurm`: processes per node of a multi-node point


def local_device(gpus: int) -> str:
    """cuda when this host has the GPUs asked for, cpu when it has none."""
    found = count_gpus()
    if found == 0:
        return "cpu"
    if found < gpus:
        raise UsageError(f"--gpus {gpus} asked for more GPUs than this machine has ({found}); "
                         f"use --gpus {found} or fewer, or --slurm for more nodes")
    return "cuda"


def _host_offer() -> tuple[str, int, str]:
    """(device, how many ranks this host offers a sweep, what they are called)."""
    gpus = count_gpus()
    if gpus:
        return "cuda", gpus, "GPUs"
    cores = usable_cores()
    return "cpu", CPU_PROCESSES_PER_CORE * cores, (f"CPU processes ({CPU_PROCESSES_PER_CORE} per "
                                                   f"usable core, {cores} cores)")


def local_sweep_placement(sizes: str) -> Placement:
    """This host, for `scale`: every world size of `sizes` ("1,2,4"), if it can hold them."""
    device, available, what = _host_offer()
    parsed = parse_world_sizes(sizes, available=available, what=what)
    return Placement(device=device, gpus=max(parsed), world_sizes=tuple(parsed))


def local_placement(*, gpus: int, force: bool) -> Placement:
    """This host: `gpus` processes (more CPU processes than the cores hold only with `force`)."""
    device = local_device(gpus)
    if device == "cpu" and not force:
        cores = usable_cores()
        if gpus > CPU_PROCESSES_PER_CORE * cores:
            raise UsageError(f"--gpus {gpus}: no GPU here, and {gpus} CPU processes "
                             f"on {cores} usable core(s) would measure contention (at most "
                             f"{CPU_PROCESSES_PER_CORE * cores}); use fewer, or --force")
    return Placement(device=device, gpus=gpus)


def slurm_spec(slurm: SlurmOptions, *, detach: bool = False) -> SlurmSpec:
    """The SlurmSpec of the merged options; CPUs per node from sinfo when nobody set them."""
    cpus = slurm.cpus_per_node
    if cpus is None and shutil.which("sinfo"):
        cpus = partition_shape(slurm.partition)[0]
    return SlurmSpec(partition=slurm.partition, account=slurm.account, qos=slurm.qos,
                     constraint=slurm.constraint, time_min=slurm.time_min,
                     opts=slurm.slurm_opt, cpus_per_node=cpus,
                     queue_timeout_min=slurm.queue_timeout_min, detach=detach)


def _partition_device(partition: str | None, gpus_per_node: int | None) -> str:
    # the login node's own hardware says nothing about the compute nodes
    if shutil.which("sinfo"):
        return "cuda" if partition_shape(partition)[1] else "cpu"
    return "cuda" if gpus_per_node else "cpu"


def _submittable(slurm: SlurmOptions, *, dry_run: bool, detach: bool) -> tuple[SlurmSpec, str]:
    """(the SlurmSpec, the partition's device); the SLURM commands must exist unless this is a
    dry run. Bad flags or dlaunch.yaml fail here, before anything runs."""
    spec = slurm_spec(slurm, detach=detach)
    if not dry_run:
        check_slurm_available()
    return spec, _partition_device(spec.partition, slurm.gpus_per_node)


def slurm_placement(command: str, slurm: SlurmOptions, *, gpus: int | None, nodes: int | None,
                    topology: str | None, dry_run: bool, detach: bool = False) -> Placement:
    """Nodes of a SLURM partition for `run`, `tune` or `doctor`: `nodes` x (--gpus-per-node or
    `gpus`) processes."""
    per_node = slurm.gpus_per_node
    if command in ("run", "tune") and per_node and gpus not in (1, per_node):
        raise UsageError(f"--gpus {gpus} and --gpus-per-node {per_node} disagree; give one")
    spec, device = _submittable(slurm, dry_run=dry_run, detach=detach)
    return Placement(device=device, nodes=nodes or 1, gpus=per_node or gpus or 1, slurm=spec,
                     topology=topology)


def slurm_sweep_placement(slurm: SlurmOptions, *, sizes: str, topology: str | None,
                          dry_run: bool) -> Placement:
    """Nodes of a SLURM partition for `scale`: its largest world size of `sizes` ("1,2,4"), on
    --gpus-per-node (else the partition's) processes per node."""
    spec, device = _submittable(slurm, dry_run=dry_run, detach=False)
    per_node = slurm.gpus_per_node
    if per_node is None and shutil.which("sinfo"):
        cpus, gpus_here = partition_shape(spec.partition)
        per_node = gpus_here if device == "cuda" else (spec.cpus_per_node or cpus)
    if not per_node:
        raise UsageError("dlaunch scale --slurm: give --gpus-per-node (processes per node); "
                         "sinfo could not tell how many the partition's nodes have")
    parsed = parse_world_sizes(sizes)
    nodes, largest = point_shape(max(parsed), per_node)
    return Placement(device=device, nodes=nodes, gpus=largest, slurm=spec, topology=topology,
                     world_sizes=tuple(parsed), per_node=per_node)

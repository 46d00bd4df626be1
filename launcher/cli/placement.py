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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from launcher.backends.slurm.jobs import partition_shape
from launcher.backends.slurm.submit import SlurmSpec, check_slurm_available
from launcher.cli.args import CPU_PROCESSES_PER_CORE
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


def local_placement(command: str, values: Mapping[str, Any]) -> Placement:
    """This host: `--gpus` processes, or for `scale` every world size it can hold."""
    if command == "scale":
        device, available, what = _host_offer()
        sizes = parse_world_sizes(values["gpus"], available=available, what=what)
        return Placement(device=device, gpus=max(sizes), world_sizes=tuple(sizes))
    device = local_device(values["gpus"])
    if device == "cpu" and not values.get("force"):
        cores = usable_cores()
        if values["gpus"] > CPU_PROCESSES_PER_CORE * cores:
            raise UsageError(f"--gpus {values['gpus']}: no GPU here, and {values['gpus']} CPU processes "
                             f"on {cores} usable core(s) would measure contention (at most "
                             f"{CPU_PROCESSES_PER_CORE * cores}); use fewer, or --force")
    return Placement(device=device, gpus=values["gpus"])


def slurm_spec(values: Mapping[str, Any]) -> SlurmSpec:
    """The SlurmSpec of the merged options; CPUs per node from sinfo when nobody set them."""
    cpus = values["cpus_per_node"]
    if cpus is None and shutil.which("sinfo"):
        cpus = partition_shape(values["partition"])[0]
    return SlurmSpec(partition=values["partition"], account=values["account"], qos=values["qos"],
                     constraint=values["constraint"], time_min=values["time_min"],
                     opts=values["slurm_opt"], cpus_per_node=cpus,
                     queue_timeout_min=values["queue_timeout_min"], detach=bool(values.get("detach")))


def _partition_device(partition: str | None, gpus_per_node: int | None) -> str:
    # the login node's own hardware says nothing about the compute nodes
    if shutil.which("sinfo"):
        return "cuda" if partition_shape(partition)[1] else "cpu"
    return "cuda" if gpus_per_node else "cpu"


def slurm_placement(command: str, values: Mapping[str, Any]) -> Placement:
    """Nodes of a SLURM partition; the SLURM commands must exist unless this is a dry run."""
    gpus, per_node = values["gpus"], values["gpus_per_node"]
    if command in ("run", "tune") and per_node and gpus not in (1, per_node):
        raise UsageError(f"--gpus {gpus} and --gpus-per-node {per_node} disagree; give one")
    slurm = slurm_spec(values)  # bad flags or dlaunch.yaml fail before anything runs
    if not values["dry_run"]:
        check_slurm_available()
    device = _partition_device(slurm.partition, per_node)
    if command != "scale":
        return Placement(device=device, nodes=values["nodes"] or 1, gpus=per_node or gpus, slurm=slurm,
                         topology=values["topology"])
    if per_node is None and shutil.which("sinfo"):
        cpus, gpus_here = partition_shape(slurm.partition)
        per_node = gpus_here if device == "cuda" else (slurm.cpus_per_node or cpus)
    if not per_node:
        raise UsageError("dlaunch scale --slurm: give --gpus-per-node (processes per node); "
                         "sinfo could not tell how many the partition's nodes have")
    sizes = parse_world_sizes(values["gpus"])
    nodes, largest = point_shape(max(sizes), per_node)
    return Placement(device=device, nodes=nodes, gpus=largest, slurm=slurm, topology=values["topology"],
                     world_sizes=tuple(sizes), per_node=per_node)

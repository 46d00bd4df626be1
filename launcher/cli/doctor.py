"""`dlaunch doctor`: a preflight of this host (or, with --slurm, of every node of a SLURM job).

Flags -> DoctorRequest (where the ranks run, how many, the GEMM's precision, the verdict
threshold, the topology to judge against), then launcher.jobs.doctor starts the ranks, collects
and judges. Prints one line per rank and per node (measured / expected, ok or SLOW), the
expected figures with their sources and the SLOW ranks and nodes with a ready `--exclude`;
`--json` prints the report as JSON. Exit 0 when every rank is within the threshold of the
median, 1 when one is SLOW or failed, 2 for bad input. Must never import torch or runtime.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from typing import Any

from launcher.backends.slurm.jobs import partition_shape
from launcher.cli.args import no_extra_args
from launcher.cli.placement import local_placement, slurm_placement
from launcher.cli.prepare import options
from launcher.errors import UsageError
from launcher.hardware.gpu_probe import count_gpus
from launcher.jobs.doctor import DoctorRequest, dry_run, expectation_topology, run_doctor, topology_file
from launcher.results.doctor import format_doctor
from launcher.rundir import new_run_id

# CPU ranks when --gpus is not given: the fewest that can be compared with each other
CPU_RANKS = 2


def _slurm_ranks(values: Mapping[str, Any], device: str, partition: str | None) -> int:
    """Ranks per node of a SLURM doctor: --gpus-per-node or --gpus, else the partition's GPUs
    (sinfo), else CPU_RANKS."""
    gpus, per_node = values["gpus"], values["gpus_per_node"]
    if gpus and per_node and gpus != per_node:
        raise UsageError(f"--gpus {gpus} and --gpus-per-node {per_node} disagree; give one")
    if per_node or gpus:
        return int(per_node or gpus)
    if device == "cuda":
        found = partition_shape(partition)[1]
        if not found:
            raise UsageError("dlaunch doctor --slurm: give --gpus-per-node; sinfo could not tell "
                             "how many GPUs the partition's nodes have")
        return int(found)
    return CPU_RANKS


def build_request(values: Mapping[str, Any]) -> DoctorRequest:
    """Where and how the doctor runs, from the merged options."""
    precision = values["precision"] or "auto"
    if values["slurm"]:
        place = slurm_placement("doctor", values)
        assert place.slurm is not None  # narrowing: a SLURM placement carries its spec
        ranks = _slurm_ranks(values, place.device, place.slurm.partition)
        return DoctorRequest(device=place.device, ranks_per_node=ranks, nodes=place.nodes,
                             precision=precision, threshold=values["threshold"],
                             topology=values["topology"], slurm=place.slurm)
    gpus = values["gpus"] or count_gpus() or CPU_RANKS
    place = local_placement("doctor", {**values, "gpus": gpus})
    return DoctorRequest(device=place.device, ranks_per_node=place.gpus, precision=precision,
                         threshold=values["threshold"], topology=values["topology"])


def cmd_doctor(args: argparse.Namespace, extra: list[str]) -> int:
    """`dlaunch doctor`: measure, compare, name the slow ranks and nodes."""
    no_extra_args("doctor", extra)
    values = options("doctor", args)
    request = build_request(values)
    run_id = new_run_id("doctor")
    if values["dry_run"]:
        topology_file(request)  # a bad --topology is bad input in a dry run too
        print(dry_run(request, run_id=run_id, run_dir=values["run_dir"]), end="")
        return 0
    basis = expectation_topology(request)  # before anything is printed or started
    if request.device == "cpu" and request.slurm is None:
        print(f"dlaunch: no CUDA GPU on this machine; checking {request.ranks_per_node} CPU "
              "rank(s) with gloo", file=sys.stderr)
    as_json = bool(values["json"])
    report = run_doctor(request, basis, run_id=run_id, run_dir=values["run_dir"],
                        console=sys.stderr if as_json else sys.stdout, debug=bool(args.debug))
    if as_json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(format_doctor(report))
        print(f"took {report.wall_s:.1f} s; rank files and doctor.json in {report.run_dir}")
    return 0 if report.ok else 1

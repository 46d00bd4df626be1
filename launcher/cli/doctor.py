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

from launcher.backends.slurm.jobs import partition_shape
from launcher.cli.args import no_extra_args
from launcher.cli.options import DoctorOptions, SlurmOptions, load
from launcher.cli.placement import local_placement, slurm_placement
from launcher.errors import UsageError
from launcher.hardware.gpu_probe import count_gpus
from launcher.jobs.doctor import DoctorRequest, dry_run, expectation_topology, run_doctor, topology_file
from launcher.results.doctor_view import format_doctor
from launcher.rundir import new_run_id

# CPU ranks when --gpus is not given: the fewest that can be compared with each other
CPU_RANKS = 2


def _slurm_ranks(gpus: int | None, slurm: SlurmOptions, device: str, partition: str | None) -> int:
    """Ranks per node of a SLURM doctor: --gpus-per-node or --gpus, else the partition's GPUs
    (sinfo), else CPU_RANKS."""
    per_node = slurm.gpus_per_node
    if gpus and per_node and gpus != per_node:
        raise UsageError(f"--gpus {gpus} and --gpus-per-node {per_node} disagree; give one")
    given = per_node or gpus
    if given:
        return given
    if device == "cuda":
        found = partition_shape(partition)[1]
        if not found:
            raise UsageError("dlaunch doctor --slurm: give --gpus-per-node; sinfo could not tell "
                             "how many GPUs the partition's nodes have")
        return int(found)
    return CPU_RANKS


def build_request(opts: DoctorOptions) -> DoctorRequest:
    """Where and how the doctor runs, from the merged options."""
    precision = opts.precision or "auto"
    if opts.slurm is not None:
        place = slurm_placement("doctor", opts.slurm, gpus=opts.gpus, nodes=opts.nodes, topology=opts.topology,
                                dry_run=opts.dry_run)
        assert place.slurm is not None  # narrowing: a SLURM placement carries its spec
        ranks = _slurm_ranks(opts.gpus, opts.slurm, place.device, place.slurm.partition)
        return DoctorRequest(device=place.device, ranks_per_node=ranks, nodes=place.nodes,
                             precision=precision, threshold=opts.threshold,
                             topology=opts.topology, slurm=place.slurm)
    place = local_placement(gpus=opts.gpus or count_gpus() or CPU_RANKS, force=opts.force)
    return DoctorRequest(device=place.device, ranks_per_node=place.gpus, precision=precision,
                         threshold=opts.threshold, topology=opts.topology)


def cmd_doctor(args: argparse.Namespace, extra: list[str]) -> int:
    """`dlaunch doctor`: measure, compare, name the slow ranks and nodes."""
    no_extra_args("doctor", extra)
    opts = load(DoctorOptions, args)
    request = build_request(opts)
    run_id = new_run_id("doctor")
    if opts.dry_run:
        topology_file(request)  # a bad --topology is bad input in a dry run too
        print(dry_run(request, run_id=run_id, run_dir=opts.run_dir), end="")
        return 0
    basis = expectation_topology(request)  # before anything is printed or started
    if request.device == "cpu" and request.slurm is None:
        print(f"dlaunch: no CUDA GPU on this machine; checking {request.ranks_per_node} CPU "
              "rank(s) with gloo", file=sys.stderr)
    as_json = opts.json
    report = run_doctor(request, basis, run_id=run_id, run_dir=opts.run_dir,
                        console=sys.stderr if as_json else sys.stdout, debug=bool(args.debug))
    if as_json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(format_doctor(report))
        print(f"took {report.wall_s:.1f} s; rank files and doctor.json in {report.run_dir}")
    return 0 if report.ok else 1

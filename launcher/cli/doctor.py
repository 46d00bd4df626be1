"""`dlaunch doctor`: a preflight of this host (or, with --slurm, of every node of a SLURM job).

Flags -> the backend and its placement (`launcher.cli.prepare.placed`: where the ranks run, how
many) -> DoctorRequest, then launcher.drivers.doctor starts the ranks through the driver,
collects and judges; the verdicts are printed (`launcher.results.doctor_view`) or, with --json,
the report. Exit 0 when every rank is within the threshold of the median, 1 when one is SLOW or
failed, 2 for bad input. Must never import torch, runtime or launcher.backends.slurm.
"""

from __future__ import annotations

import argparse
import json
import sys

from launcher.cli.options import DoctorOptions, load
from launcher.cli.prepare import placed
from launcher.drivers.doctor import DoctorRequest, doctor_spec, expectation_topology, run_doctor, topology_file
from launcher.results.doctor_view import format_doctor
from launcher.rundir import new_run_id


def cmd_doctor(args: argparse.Namespace, extra: list[str]) -> int:
    """`dlaunch doctor`: measure, compare, name the slow ranks and nodes."""
    opts = load(DoctorOptions, args)
    backend, place = placed(opts)
    request = DoctorRequest(device=place.device, ranks_per_node=place.gpus, nodes=place.nodes, threshold=opts.threshold,
                            precision=opts.precision or "auto", topology=opts.topology, placement=place)
    run_id = new_run_id("doctor")
    if opts.dry_run:
        topology_file(request)  # a bad --topology is bad input in a dry run too
        spec = doctor_spec(request, run_id=run_id, run_dir=opts.run_dir)
        print(backend.render(spec, place).dry_run_text, end="")
        return 0
    basis = expectation_topology(request)  # before anything is printed or started
    if place.notice:
        print(f"dlaunch: {place.notice}; checking {request.ranks_per_node} CPU rank(s) with gloo", file=sys.stderr)
    report = run_doctor(request, basis, backend, run_id=run_id, run_dir=opts.run_dir,
                        console=sys.stderr if opts.json else sys.stdout, debug=bool(args.debug))
    if opts.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(format_doctor(report))
        print(f"took {report.wall_s:.1f} s; rank files and doctor.json in {report.run_dir}")
    return 0 if report.ok else 1

"""`dlaunch scale`: a scaling sweep, one run per world size (and repeat), resumable, then its report.

The request is built like `run`'s (`launcher.cli.prepare`) for the sweep's largest point: the
plan fills strategy, precision, checkpointing and, in weak scaling, micro-batch and accumulation
when the flags leave them open, and every point runs with those choices. The sweep itself is
`launcher.drivers.sweep`'s: a `Sweep` of the request's LaunchSpec, each point launched by the
driver on the backend the flags pick. Must never import torch.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import IO

from launcher.cli.options import ScaleOptions, load
from launcher.cli.prepare import build_request
from launcher.cli.report import print_report
from launcher.cli.run import note
from launcher.drivers.launch import Runner
from launcher.drivers.sweep import Sweep, default_sweep_dir, run_sweep
from launcher.drivers.sweepdir import refuse_foreign
from launcher.hardware.detect import detect_topology
from launcher.hardware.topology import load_topology, topology_to_dict
from launcher.plan.planfile import write_plan
from launcher.report.render import render_report
from launcher.request import point_plan
from launcher.results.types import RunResult
from launcher.runspec import LaunchSpec

log = logging.getLogger(__name__)


def cmd_scale(args: argparse.Namespace, workload_args: list[str]) -> int:
    """`dlaunch scale`: run (or resume) the sweep, then write its report."""
    opts = load(ScaleOptions, args)
    request, place, backend = build_request(opts, workload_args)
    template = request.launch_spec(run_id="", run_dir="")  # each point gets its own identity
    sweep = Sweep(template=template, shapes=place.shapes, mode=opts.mode, repeats=opts.repeat,
                  global_batch=opts.global_batch, per_node=place.per_node)
    sweep_dir = Path(opts.sweep_dir) if opts.sweep_dir else default_sweep_dir(sweep.config())
    refuse_foreign(sweep_dir.absolute())  # before the plan's note: a refusal is one line
    note(request.plan_note)
    if opts.dry_run:
        t = template
        print(f"# sweep {sweep_dir.absolute()}: {sweep.mode} scaling on {t.device} ({place.where}), "
              f"strategy {t.strategy}, precision {t.precision}"
              + (f", checkpointing {t.checkpointing}" if t.checkpointing != "none" else ""))
        for n, nodes, procs in sweep.shapes:
            for k in range(sweep.repeats):
                print(f"ws{n}-r{k}: {n} rank(s) = {nodes} node(s) x {procs}, micro-batch {sweep.batch(n)}, "
                      f"global batch {sweep.batch(n) * t.grad_accum * n}, {t.steps} steps")
        return 0
    # a sweep on other nodes (SLURM) describes them only through --topology (or slurm.topology
    # in dlaunch.yaml): never by detecting the login node it is started from
    topology = None
    if opts.topology:
        topology = topology_to_dict(load_topology(opts.topology))
    elif place.here:
        try:
            topology = topology_to_dict(detect_topology(device=request.device))
        except Exception as e:  # detection only adds the link column and the prediction
            log.warning("could not detect this machine's topology: %s", e)
    runner = Runner(backend=backend, placement=place)

    def run_point(spec: LaunchSpec, out: IO[str]) -> RunResult:
        # one prediction per point, the plan at its shape: its summary and the report read it
        if (planned := point_plan(request, spec, topology=place.topology)) is not None:
            write_plan(spec.run_dir, planned)
        return runner(spec, out)

    result = run_sweep(sweep, sweep_dir=sweep_dir, run=run_point, force=opts.force, topology=topology,
                       progress=sys.stderr)
    reported = not opts.no_report and any(p.status == "ok" for p in result.points)
    files, report = render_report(result.sweep_dir) if reported else ([], None)
    if opts.json:
        print(json.dumps({"sweep_dir": str(result.sweep_dir), "ran": result.ran, "skipped": result.skipped,
                          "points": [p.__dict__ for p in result.points], "report": report.to_dict() if report else None,
                          "files": [str(f) for f in files]}, indent=2))
    else:
        print_report(result.sweep_dir, report, files)
        for p in result.failed:
            print(f"FAILED: {p.name}: {p.error}")
    return 0 if result.ok else 1

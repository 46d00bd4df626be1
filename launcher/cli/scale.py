"""`dlaunch scale`: a scaling sweep, one run per world size (and repeat), resumable, then its report.

The request is built like `run`'s (`launcher.cli.prepare`) for the sweep's largest point: the
plan fills strategy, precision, checkpointing and, in weak scaling, micro-batch and accumulation
when the flags leave them open, and every point runs with those choices. The sweep itself is
`launcher.jobs.sweep`'s. Must never import torch.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import IO, Any

from launcher.cli.options import ScaleOptions, load
from launcher.cli.placement import Placement
from launcher.cli.prepare import build_request
from launcher.cli.report import print_report
from launcher.cli.run import note
from launcher.hardware.detect import detect_topology
from launcher.hardware.topology import load_topology, topology_to_dict
from launcher.jobs.slurm import run_slurm
from launcher.jobs.sweep import check_plan, default_sweep_dir, point_shape, run_sweep, sweep_config
from launcher.jobs.sweepdir import refuse_foreign
from launcher.jobs.sweeppoints import LaunchPoint
from launcher.report.render import render_report
from launcher.report.types import ScalingReport
from launcher.results.types import RunResult
from launcher.specs import LaunchSpec

log = logging.getLogger(__name__)

# LaunchSpec fields that differ from point to point (or that run_sweep takes on their own)
_PER_POINT = ("workload", "workload_args", "num_nodes", "nproc_per_node", "micro_batch", "steps",
              "warmup_steps")


def _topology_dict(name: str | None, device: str) -> dict[str, Any] | None:
    if name:
        return topology_to_dict(load_topology(name))
    try:
        return topology_to_dict(detect_topology(device=device))
    except Exception as e:  # detection only adds the link column and the prediction
        log.warning("could not detect this machine's topology: %s", e)
        return None


def _slurm_points(place: Placement) -> LaunchPoint | None:
    """Each point as one SLURM job, followed like `run --slurm`; None on this host."""
    slurm = place.slurm
    if slurm is None:
        return None

    def launch_point(spec: LaunchSpec, console: IO[str]) -> RunResult:
        result = run_slurm(spec, slurm, out=console)
        assert result is not None  # a sweep never detaches
        return result

    return launch_point


def cmd_scale(args: argparse.Namespace, workload_args: list[str]) -> int:
    """`dlaunch scale`: run (or resume) the sweep, then write its report."""
    opts = load(ScaleOptions, args)
    request, place = build_request(opts, workload_args)
    mode, sizes = opts.mode, place.world_sizes
    shapes = {n: point_shape(n, place.per_node) for n in sizes}
    chosen = request.decisions()
    batches = check_plan(mode, sizes, micro_batch=chosen["micro_batch"], global_batch=opts.global_batch,
                         grad_accum=chosen["grad_accum"])
    base = {k: v for k, v in request.spec_fields().items() if k not in _PER_POINT}
    config = sweep_config(workload=request.workload, workload_args=request.workload_args, mode=mode,
                          global_batch=opts.global_batch, micro_batch=chosen["micro_batch"],
                          steps=request.steps, warmup_steps=request.warmup, base_spec_kwargs=base,
                          processes_per_node=place.per_node)
    sweep_dir = Path(opts.sweep_dir) if opts.sweep_dir else default_sweep_dir(config)
    refuse_foreign(sweep_dir.absolute())  # before the plan's note: a refusal is one line
    note(request.plan_note)
    if opts.dry_run:
        where = "SLURM jobs" if place.slurm else "this host"
        print(f"# sweep {sweep_dir.absolute()}: {mode} scaling on {request.device} ({where}), "
              f"strategy {chosen['strategy']}, precision {chosen['precision']}"
              + (f", checkpointing {chosen['checkpointing']}" if chosen["checkpointing"] != "none" else ""))
        for n in sizes:
            nodes, procs = shapes[n]
            for k in range(opts.repeat):
                print(f"ws{n}-r{k}: {n} rank(s) = {nodes} node(s) x {procs}, micro-batch {batches[n]}, "
                      f"global batch {batches[n] * chosen['grad_accum'] * n}, {request.steps} steps")
        return 0
    # a SLURM sweep describes its nodes only through --topology (or slurm.topology in
    # dlaunch.yaml): never by detecting the login node it is started from
    topology = _topology_dict(opts.topology, request.device) if opts.topology or not place.slurm else None
    result = run_sweep(workload=request.workload, workload_args=request.workload_args, world_sizes=sizes,
                       mode=mode, global_batch=opts.global_batch, micro_batch=chosen["micro_batch"],
                       steps=request.steps, warmup_steps=request.warmup, repeats=opts.repeat,
                       sweep_dir=sweep_dir, force=opts.force, base_spec_kwargs=base,
                       topology=topology, processes_per_node=place.per_node,
                       launch_point=_slurm_points(place), progress=sys.stderr)
    files: list[Path] = []
    report: ScalingReport | None = None
    if not opts.no_report and any(p.status == "ok" for p in result.points):
        files, report = render_report(result.sweep_dir)
    if opts.json:
        print(json.dumps({"sweep_dir": str(result.sweep_dir), "ran": result.ran,
                          "skipped": result.skipped,
                          "points": [p.__dict__ for p in result.points],
                          "report": report.to_dict() if report else None,
                          "files": [str(f) for f in files]}, indent=2))
    else:
        print_report(result.sweep_dir, report, files)
        for p in result.failed:
            print(f"FAILED: {p.name}: {p.error}")
    return 0 if result.ok else 1

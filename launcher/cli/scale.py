"""Arguments and handlers of `dlaunch scale` and `dlaunch report`, for `launcher.cli.main` to wire.

Kept apart from cli.py so the sweep and report code can change without touching the parser
module; cli.py adds the two subcommands with `add_scale_args` / `add_report_args` and calls
`cmd_scale` / `cmd_report`. Both raise DlaunchError for bad input (one line, exit 2).
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys
from pathlib import Path
from typing import Any

from launcher.cli.args import int_at_least
from launcher.errors import UsageError

log = logging.getLogger(__name__)

CPU_PROCESSES_PER_CORE = 4  # beyond this a CPU sweep measures contention, not scaling


def add_scale_args(p: argparse.ArgumentParser) -> None:
    """The arguments of `dlaunch scale`."""
    p.add_argument("workload", help="workload file (see workloads/)")
    p.add_argument("--gpus", required=True, metavar="N,N,...",
                   help="world sizes to run, comma-separated (e.g. 1,2,4,8)")
    p.add_argument("--mode", choices=("weak", "strong"), default="weak",
                   help="weak: keep --micro-batch per rank; strong: keep --global-batch")
    p.add_argument("--global-batch", type=int_at_least("--global-batch", 1), default=None,
                   help="samples per optimizer step for --mode strong (every world size must divide it)")
    p.add_argument("--micro-batch", type=int_at_least("--micro-batch", 1), default=8,
                   help="samples per rank per forward pass (weak scaling)")
    p.add_argument("--repeat", type=int_at_least("--repeat", 1), default=1, help="runs per world size")
    p.add_argument("--steps", type=int_at_least("--steps", 1), default=20, help="optimizer steps per run")
    p.add_argument("--warmup-steps", type=int_at_least("--warmup-steps", 0), default=None,
                   help="steps left out of throughput (default: min(3, steps - 1))")
    p.add_argument("--grad-accum", type=int_at_least("--grad-accum", 1), default=1)
    p.add_argument("--strategy", choices=("ddp", "fsdp_full", "fsdp_grad_op", "hybrid"), default="ddp")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing per block")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--seed", type=int_at_least("--seed", 0), default=0)
    p.add_argument("--num-workers", type=int_at_least("--num-workers", 0), default=0)
    p.add_argument("--sweep-dir", default=None,
                   help="where the sweep goes (default runs/scale-<workload>-<mode>-<hash>: the "
                        "same command resumes the same sweep)")
    p.add_argument("--force", action="store_true", help="re-run points that already finished")
    p.add_argument("--topology", default=None,
                   help="topology file or name for link bandwidth and predictions (default: detect)")
    p.add_argument("--no-report", action="store_true", help="do not write the report at the end")
    p.add_argument("--dry-run", action="store_true", help="print the points and commands, run nothing")
    p.add_argument("--json", action="store_true", help="print the sweep and report as JSON")
    from launcher.cli.slurm import add_slurm_args

    add_slurm_args(p, sweep=True)


def add_report_args(p: argparse.ArgumentParser) -> None:
    """The arguments of `dlaunch report`."""
    p.add_argument("path", metavar="RUN_OR_SWEEP_DIR", help="a run directory or a sweep directory")
    p.add_argument("--format", default="html,md,json,png",
                   help="comma-separated: html, md, json, png (default all)")
    p.add_argument("--out", default=None, help="output directory (default RUN_OR_SWEEP_DIR/report)")
    p.add_argument("--topology", default=None,
                   help="topology file or name: link bandwidth and predictions (default: the one "
                        "the sweep recorded, or this machine when it ran the job)")
    p.add_argument("--no-predict", action="store_true", help="skip the planner's prediction")
    p.add_argument("--json", action="store_true", help="print the report's numbers as JSON")


def _devices() -> tuple[str, int, str]:
    """(device, how many ranks one host offers, what they are called)."""
    from launcher.backends.local import usable_cores
    from launcher.hardware.gpu_probe import count_gpus

    gpus = count_gpus()
    if gpus:
        return "cuda", gpus, "GPUs"
    cores = usable_cores()
    return "cpu", CPU_PROCESSES_PER_CORE * cores, (f"CPU processes ({CPU_PROCESSES_PER_CORE} per "
                                                   f"usable core, {cores} cores)")


def _topology_dict(name: str | None, device: str) -> dict[str, Any] | None:
    from launcher.hardware.topology import load_topology, topology_to_dict

    if name:
        return topology_to_dict(load_topology(name))
    try:
        from launcher.hardware.detect import detect_topology

        return topology_to_dict(detect_topology(device=device))
    except Exception as e:  # detection only adds the link column and the prediction
        log.warning("could not detect this machine's topology: %s", e)
        return None


def cmd_scale(args: argparse.Namespace, workload_args: list[str]) -> int:
    """`dlaunch scale`: run (or resume) the sweep, then write its report."""
    from launcher.cli import slurm
    from launcher.jobs.sweep import (
        check_plan,
        default_sweep_dir,
        parse_world_sizes,
        point_shape,
        run_sweep,
        sweep_config,
    )
    from launcher.specs import LoaderSpec, Strategy
    from launcher.workload import inspect_file

    if not args.slurm:
        slurm.reject_without_slurm(args, sweep=True)
    kind = inspect_file(args.workload)
    if kind.is_script:
        raise UsageError(f"dlaunch scale needs a workload file (the harness sets each point's "
                         f"batch); {args.workload} is a plain script")
    per_node = launch_point = None
    if args.slurm:
        # the partition's nodes, not this login node, decide the device and the node shape
        device, per_node, launch_point = slurm.sweep_backend(args)
        sizes = parse_world_sizes(args.gpus)
        shapes = {n: point_shape(n, per_node) for n in sizes}
    else:
        device, available, what = _devices()
        sizes = parse_world_sizes(args.gpus, available=available, what=what)
        shapes = {n: (1, n) for n in sizes}
    if args.warmup_steps is not None and args.warmup_steps >= args.steps:
        raise UsageError(f"--warmup-steps must be below --steps ({args.steps}), got {args.warmup_steps}")
    warmup = args.warmup_steps if args.warmup_steps is not None else min(3, args.steps - 1)
    base = {"device": device, "grad_accum_steps": args.grad_accum, "seed": args.seed,
            "strategy": Strategy(kind=args.strategy, precision=args.precision,
                                 activation_checkpointing=args.checkpointing, compile=args.compile),
            "loader": LoaderSpec(num_workers=args.num_workers)}
    batches = check_plan(args.mode, sizes, micro_batch=args.micro_batch,
                         global_batch=args.global_batch, grad_accum=args.grad_accum)
    config = sweep_config(workload=str(kind.path), workload_args=workload_args, mode=args.mode,
                          global_batch=args.global_batch, micro_batch=args.micro_batch,
                          steps=args.steps, warmup_steps=warmup, base_spec_kwargs=base,
                          processes_per_node=per_node)
    sweep_dir = Path(args.sweep_dir) if args.sweep_dir else default_sweep_dir(config)
    if args.dry_run:
        where = "SLURM jobs" if args.slurm else "this host"
        print(f"# sweep {sweep_dir.absolute()}: {args.mode} scaling on {device} ({where})")
        for n in sizes:
            nodes, procs = shapes[n]
            for k in range(args.repeat):
                print(f"ws{n}-r{k}: {n} rank(s) = {nodes} node(s) x {procs}, micro-batch {batches[n]}, "
                      f"global batch {batches[n] * args.grad_accum * n}, {args.steps} steps")
        return 0
    # a SLURM sweep describes its nodes only through --topology (or slurm.topology in
    # dlaunch.yaml): never by detecting the login node it is started from
    if args.slurm and not args.topology:
        from launcher.config import load_config

        args.topology = load_config().slurm.topology
    topology = (_topology_dict(args.topology, device) if args.topology or not args.slurm else None)
    result = run_sweep(workload=str(kind.path), workload_args=workload_args, world_sizes=sizes,
                       mode=args.mode, global_batch=args.global_batch,
                       micro_batch=args.micro_batch, steps=args.steps, warmup_steps=warmup,
                       repeats=args.repeat, sweep_dir=sweep_dir, force=args.force,
                       base_spec_kwargs=base, topology=topology, processes_per_node=per_node,
                       launch_point=launch_point, progress=sys.stderr)
    files: list[Path] = []
    report = None
    if not args.no_report and any(p.status == "ok" for p in result.points):
        from launcher.report.render import render_report

        files, report = render_report(result.sweep_dir)
    if args.json:
        print(json.dumps({"sweep_dir": str(result.sweep_dir), "ran": result.ran,
                          "skipped": result.skipped,
                          "points": [p.__dict__ for p in result.points],
                          "report": report.to_dict() if report else None,
                          "files": [str(f) for f in files]}, indent=2))
    else:
        _print_report(result.sweep_dir, report, files)
        for p in result.failed:
            print(f"FAILED: {p.name}: {p.error}")
    return 0 if result.ok else 1


def _print_report(path: Path, report: Any, files: list[Path]) -> None:
    from launcher.report.render import summary_lines

    print(f"sweep/run: {path}")
    if report is not None:
        print("\n".join(summary_lines(report)))
    html = next((f for f in files if f.suffix == ".html"), None)
    if html is not None:
        print(f"report: {html}")
    elif files:
        print(f"report: {files[0].parent}/ ({', '.join(f.name for f in files)})")


def _run_host(path: Path) -> str | None:
    """The host that ran rank 0 of the first run under `path`, from its start record."""
    for candidate in [path, *sorted(path.glob("*/"))][:50]:
        f = candidate / "rank-0.jsonl"
        if f.is_file():
            with open(f, encoding="utf-8", errors="replace") as fh:
                try:
                    return str(json.loads(fh.readline()).get("host"))
                except ValueError:
                    return None
    return None


def cmd_report(args: argparse.Namespace, workload_args: list[str]) -> int:
    """`dlaunch report`: HTML / Markdown / JSON / PNG of a run or sweep directory."""
    from launcher.report.render import parse_formats, render_report

    if workload_args:
        raise UsageError(f"dlaunch report takes no arguments after `--`, got {' '.join(workload_args)!r}")
    formats = parse_formats(args.format)
    path = Path(args.path)
    topology = fallback = None
    if args.topology:
        from launcher.hardware.topology import load_topology

        topology = load_topology(args.topology)
    elif path.is_dir() and _run_host(path) == socket.gethostname().split(".")[0]:
        try:
            from launcher.hardware.detect import detect_topology

            fallback = detect_topology()
        except Exception as e:  # only the link column and the prediction need it
            log.warning("could not detect this machine's topology: %s", e)
    files, report = render_report(path, formats, out_dir=args.out, topology=topology,
                                  default_topology=fallback, with_prediction=not args.no_predict)
    if args.json:
        print(json.dumps({**report.to_dict(), "files": [str(f) for f in files]}, indent=2))
    else:
        _print_report(path, report, files)
    return 0


__all__ = ["add_scale_args", "add_report_args", "cmd_scale", "cmd_report"]

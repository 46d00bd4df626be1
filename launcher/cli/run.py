"""`dlaunch run` and `dlaunch lab` from parsed arguments: their flags, following the plan for
the decisions the user left open, and the LaunchSpec they become. Only CLI modules see argv."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from launcher.cli.args import int_at_least
from launcher.errors import UsageError

log = logging.getLogger(__name__)


def add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("workload", help="workload file (see workloads/) or a plain torchrun script")
    p.add_argument("--gpus", type=int_at_least("--gpus", 1), default=1,
                   help="processes per node: GPUs, or CPU processes when there is no GPU")
    p.add_argument("--steps", type=int_at_least("--steps", 1), default=20, help="optimizer steps")
    p.add_argument("--warmup-steps", type=int_at_least("--warmup-steps", 0), default=None,
                   help="steps left out of throughput (default: min(3, steps - 1))")
    # strategy, precision, batch and checkpointing default to the plan for this machine
    # (what `dlaunch plan` prints); each flag overrides the plan
    p.add_argument("--micro-batch", type=int_at_least("--micro-batch", 1), default=None,
                   help="samples per rank per forward pass (default: the plan's)")
    p.add_argument("--grad-accum", type=int_at_least("--grad-accum", 1), default=None,
                   help="micro-batches per optimizer step (default: the plan's)")
    p.add_argument("--global-batch", type=int_at_least("--global-batch", 1), default=None,
                   help="samples per optimizer step for the plan (default: its choice)")
    p.add_argument("--strategy", choices=("ddp", "fsdp_full", "fsdp_grad_op", "hybrid"),
                   default=None, help="default: the plan's")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=None,
                   help="default: the plan's")
    p.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=None,
                   help="activation checkpointing per block (default: the plan's)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    add_compile_diag_args(p)
    p.add_argument("--seed", type=int_at_least("--seed", 0), default=0)
    p.add_argument("--log-every", type=int_at_least("--log-every", 1), default=10,
                   help="steps per logging window (one host sync per window)")
    p.add_argument("--max-grad-norm", type=float, default=0.0,
                   help="clip the global gradient norm once per optimizer step (0: off)")
    p.add_argument("--no-calibrate", action="store_true",
                   help="skip the window that measures exposed communication and busbw")
    p.add_argument("--num-workers", type=int_at_least("--num-workers", 0), default=0,
                   help="DataLoader worker processes per rank")
    p.add_argument("--script", action="store_true",
                   help="treat the file as a plain torchrun script even if it looks like a workload")
    p.add_argument("--run-dir", default=None, help="where this run's files go (default runs/<id>)")
    p.add_argument("--dry-run", action="store_true", help="print the command and start nothing")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    add_fault_args(p)


def add_fault_args(p: argparse.ArgumentParser) -> None:
    """Hang detection and restarts (launcher.backends.monitor, launcher.jobs.local)."""
    p.add_argument("--hang-timeout-s", type=float, default=300.0,
                   help="end the job when no rank advanced for this long (0: never); the "
                        "collective timeout is twice this (default 300)")
    p.add_argument("--startup-timeout-s", type=float, default=None,
                   help="allowance before every rank finished step 1: imports, model build, "
                        "compile, rendezvous (default max(900, --hang-timeout-s))")
    p.add_argument("--max-restarts", type=int_at_least("--max-restarts", 0), default=0,
                   help="relaunch a failed job up to N times (fresh rendezvous, same run dir); "
                        "it resumes from the last checkpoint (see --checkpoint-every)")
    p.add_argument("--checkpoint-every", type=int_at_least("--checkpoint-every", 0), default=0,
                   help="save a checkpoint (torch.distributed.checkpoint, RUN_DIR/checkpoints) "
                        "every N optimizer steps (0: only on the preemption signal); restarts "
                        "and SLURM requeues resume from the newest with the same data order")


def _detect_device(requested: int) -> str:
    """cuda when this host has the GPUs asked for, cpu when it has none."""
    from launcher.hardware.gpu_probe import count_gpus

    found = count_gpus()
    if found == 0:
        return "cpu"
    if found < requested:
        raise UsageError(f"--gpus {requested} asked for more GPUs than this machine has ({found}); "
                         f"use --gpus {found} or fewer, or --slurm for more nodes")
    return "cuda"


def launch_spec_from_args(args: argparse.Namespace, workload_args: Sequence[str], *,
                          device: str, run_dir: str, run_id: str, is_script: bool) -> Any:
    """Turn parsed `run` arguments into a LaunchSpec."""
    from launcher.specs import LaunchSpec, LoaderSpec, Strategy

    warmup = args.warmup_steps if args.warmup_steps is not None else min(3, args.steps - 1)
    _fill_fallbacks(args)
    return LaunchSpec(
        workload=args.workload_path, workload_args=tuple(workload_args),
        is_script=is_script, run_id=run_id, run_dir=run_dir, device=device,
        nproc_per_node=args.gpus, steps=args.steps, warmup_steps=warmup,
        micro_batch=args.micro_batch, grad_accum_steps=args.grad_accum, seed=args.seed,
        log_every=args.log_every, calibrate_comm=not args.no_calibrate,
        max_grad_norm=args.max_grad_norm,
        hang_timeout_s=args.hang_timeout_s, max_restarts=args.max_restarts,
        checkpoint_every=getattr(args, "checkpoint_every", 0) or 0,
        startup_timeout_s=(args.startup_timeout_s if args.startup_timeout_s is not None
                           else max(900.0, args.hang_timeout_s)),
        strategy=Strategy(kind=args.strategy, precision=args.precision,
                          activation_checkpointing=args.checkpointing, compile=_wants_compile(args),
                          compile_mode=getattr(args, "compile_mode", None) or "default",
                          compile_strict=getattr(args, "compile_strict", False)),
        loader=LoaderSpec(num_workers=args.num_workers),
        shard_group_size=getattr(args, "shard_group_size", None) or 0,
        profile=getattr(args, "profile", False),
        memory_snapshot=getattr(args, "memory_snapshot", False),
        detect_anomaly=getattr(args, "detect_anomaly", False),
    )


# what `run` uses for decisions nobody made: plain scripts (not planned), or the flags gave
# strategy, precision and micro-batch, so there was nothing left to plan
RUN_FALLBACKS = {"strategy": "ddp", "precision": "fp32", "micro_batch": 8, "grad_accum": 1,
                 "checkpointing": False}


def _fill_fallbacks(args: argparse.Namespace) -> None:
    for key, value in RUN_FALLBACKS.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)


def write_plan(run_dir: str, planned: Any) -> None:
    """Keep the plan beside the run, so reports can set predicted against measured."""
    import dataclasses

    from launcher.files import atomic_write_json
    from launcher.rundir import PLAN_FILE

    atomic_write_json(os.path.join(run_dir, PLAN_FILE), {
        "plan": planned.plan.to_dict(), "profile": dataclasses.asdict(planned.profile),
        "topology": planned.topology.name})


def follow_plan(args: argparse.Namespace, workload_args: Sequence[str], *, topology: str | None = None,
                nodes: int = 1, device: str | None = None) -> str | None:
    """Fill the decisions the user left open from the plan; a note to print.

    The plan is for this machine, or for `topology` (a file: a SLURM partition's nodes) with
    `nodes` nodes of `args.gpus` devices, whose device kind must be `device` when given.
    Flags override the plan; an override predicted not to fit is warned about, not refused.
    When strategy, precision and micro-batch are all given there is nothing to plan.
    """
    given = {"strategy": args.strategy, "precision": args.precision, "micro_batch": args.micro_batch}
    if all(v is not None for v in given.values()):
        return None
    from launcher.plan.resolve import plan_workload, resolve_topology
    from launcher.plan.search import label
    from launcher.specs import Goal

    topo = resolve_topology(topology=topology, gpus=args.gpus, nodes=nodes)
    if device is not None and topo.device != device:
        raise UsageError(f"--topology {topology} describes {topo.device} nodes but the partition's "
                         f"nodes are {device}; give a topology file of the partition's nodes")
    global_batch = args.global_batch
    if global_batch is None and args.micro_batch is not None and args.grad_accum is not None:
        global_batch = args.micro_batch * args.grad_accum * args.gpus * nodes
    overrides = {**{k: v for k, v in given.items() if v is not None},
                 "activation_checkpointing": args.checkpointing, "compile": _wants_compile(args) or None}
    planned = plan_workload(args.workload_path, workload_args, topo,
                            Goal(global_batch=global_batch), overrides=overrides)
    chosen = planned.plan.chosen
    args.planned = planned
    args.strategy = chosen.strategy.kind
    args.precision = chosen.strategy.precision
    args.micro_batch = chosen.micro_batch
    args.grad_accum = chosen.grad_accum_steps
    args.checkpointing = chosen.strategy.activation_checkpointing
    warnings = [r for r in planned.plan.reasons if r.startswith("warning:")]
    note = (f"dlaunch: plan: {label(chosen)}, micro-batch {chosen.micro_batch} x "
            f"{chosen.grad_accum_steps} accumulation, predicted {chosen.time.step_time_s:.3g} s/step "
            f"and {chosen.memory.total_gib:.2f} GiB/rank (`dlaunch plan` says why)")
    return "\n".join([note, *(f"dlaunch: {w}" for w in warnings)])


def cmd_run(args: argparse.Namespace, workload_args: list[str]) -> int:
    """`dlaunch run`: launch and summarise."""
    from launcher.cli import slurm

    if args.slurm:
        return slurm.run_from_args(args, workload_args)
    slurm.reject_without_slurm(args)
    from launcher.backends import local
    from launcher.rundir import create_run_dir, new_run_id
    from launcher.workload import inspect_file

    kind = inspect_file(args.workload, force_script=args.script)
    args.workload_path = str(kind.path)
    if args.warmup_steps is not None and args.warmup_steps >= args.steps:
        raise UsageError(f"--warmup-steps must be below --steps ({args.steps}), got {args.warmup_steps}")
    device = _detect_device(args.gpus)
    plan_note = None if kind.is_script else follow_plan(args, workload_args)
    run_id = new_run_id(args.workload)
    if args.dry_run:
        from launcher.jobs.local import dry_run_text

        if plan_note:
            print(plan_note, file=sys.stderr)
        run_dir = os.path.abspath(args.run_dir or os.path.join("runs", run_id))
        spec = launch_spec_from_args(args, workload_args, device=device, run_dir=run_dir,
                                     run_id=run_id, is_script=kind.is_script)
        print(dry_run_text(spec, local.render(spec)), end="")
        return 0
    # validate everything before creating the run dir, so bad input writes nothing
    launch_spec_from_args(args, workload_args, device=device, run_dir="/nonexistent",
                          run_id=run_id, is_script=kind.is_script)
    run_dir = str(create_run_dir(args.run_dir, run_id))
    if device == "cpu":
        print(f"dlaunch: no CUDA GPU on this machine; running {args.gpus} CPU process(es) with gloo",
              file=sys.stderr)
    if plan_note:
        print(plan_note, file=sys.stderr)
        write_plan(run_dir, args.planned)
    spec = launch_spec_from_args(args, workload_args, device=device, run_dir=run_dir,
                                 run_id=run_id, is_script=kind.is_script)
    from launcher.jobs.local import run_local

    result = run_local(spec, as_json=args.json, debug=args.debug)
    return result.exit_code if result.exit_code != 0 else (0 if result.status == "ok" else 1)


def add_compile_diag_args(p: argparse.ArgumentParser) -> None:
    """Compile options, the hybrid mesh shape and the diagnostics (launcher.runtime.profiling)."""
    from launcher.specs import COMPILE_MODES

    p.add_argument("--compile-mode", choices=COMPILE_MODES, default=None,
                   help="torch.compile mode (implies --compile; default: default)")
    p.add_argument("--compile-strict", action="store_true",
                   help="fullgraph=True, and a compile failure fails the run instead of falling "
                        "back to eager (implies --compile)")
    p.add_argument("--shard-group-size", type=int_at_least("--shard-group-size", 1), default=None,
                   help="hybrid shard: ranks per shard group (default: the ranks of a node)")
    p.add_argument("--profile", action="store_true",
                   help="torch.profiler over 3 steps after warm-up: trace-rank<r>.json per rank "
                        "and the top operators in the summary")
    p.add_argument("--memory-snapshot", action="store_true",
                   help="CUDA only: record allocations, dump memory-rank<r>.pickle at the end or "
                        "on out-of-memory")
    p.add_argument("--detect-anomaly", action="store_true",
                   help="autograd anomaly detection: find the op that makes NaNs (slow)")


def _wants_compile(args: argparse.Namespace) -> bool:
    return bool(args.compile or getattr(args, "compile_mode", None)
                or getattr(args, "compile_strict", False))


def cmd_lab(args: argparse.Namespace, workload_args: list[str]) -> int:
    """`dlaunch lab`: fp32, mixed precision and mixed precision + compile (launcher.jobs.lab)."""
    from launcher.backends import local
    from launcher.jobs.lab import detect_precisions, format_lab, lab_specs, run_lab
    from launcher.rundir import create_run_dir, new_run_id
    from launcher.workload import inspect_file

    for flag, given in (("--precision", args.precision), ("--compile", _wants_compile(args)),
                        ("--script", args.script)):
        if given:
            raise UsageError(f"dlaunch lab chooses precision and compile itself; drop {flag}")
    kind = inspect_file(args.workload)
    if kind.is_script:
        raise UsageError(f"dlaunch lab needs a workload, and {args.workload!r} is a plain script")
    args.workload_path = str(kind.path)
    if args.warmup_steps is not None and args.warmup_steps >= args.steps:
        raise UsageError(f"--warmup-steps must be below --steps ({args.steps}), got {args.warmup_steps}")
    device = _detect_device(args.gpus)
    plan_note = follow_plan(args, workload_args)  # precision is never given: always plans
    precisions = detect_precisions(device, args.precision)
    run_id = "lab-" + new_run_id(args.workload)
    run_dir = os.path.abspath(args.run_dir or os.path.join("runs", run_id))
    base = launch_spec_from_args(args, workload_args, device=device, run_dir=run_dir,
                                 run_id=run_id, is_script=False)
    if args.dry_run:
        for name, spec in lab_specs(base, precisions.mixed):
            print(f"# {name}\n{local.render(spec).shell_line()}")
        return 0
    run_dir = str(create_run_dir(args.run_dir, run_id))
    base = launch_spec_from_args(args, workload_args, device=device, run_dir=run_dir,
                                 run_id=run_id, is_script=False)
    if plan_note:
        print(plan_note, file=sys.stderr)
    print(f"dlaunch lab: {precisions.note}", file=sys.stderr)
    lab = run_lab(base, precisions)
    print(json.dumps(lab.to_dict(), indent=2) if args.json else format_lab(lab))
    return 0 if lab.ok else 1

"""The `dlaunch` command: argv in, specs out, one line and exit code 2 for bad input.

Only this module sees argv and exit codes. Heavy imports (torch, matplotlib) happen inside
the command that needs them, so `dlaunch --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from launcher.errors import DlaunchError, UsageError

log = logging.getLogger(__name__)


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage, so every error is one line."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def _int_type(flag: str, minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise UsageError(f"{flag} must be an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise UsageError(f"{flag} must be an integer >= {minimum}, got {value}")
        return value

    return parse


def _add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("workload", help="workload file (see workloads/) or a plain torchrun script")
    p.add_argument("--gpus", type=_int_type("--gpus", 1), default=1,
                   help="processes per node: GPUs, or CPU processes when there is no GPU")
    p.add_argument("--steps", type=_int_type("--steps", 1), default=20, help="optimizer steps")
    p.add_argument("--warmup-steps", type=_int_type("--warmup-steps", 0), default=None,
                   help="steps left out of throughput (default: min(3, steps - 1))")
    p.add_argument("--micro-batch", type=_int_type("--micro-batch", 1), default=8,
                   help="samples per rank per forward pass")
    p.add_argument("--grad-accum", type=_int_type("--grad-accum", 1), default=1,
                   help="micro-batches per optimizer step")
    p.add_argument("--strategy", choices=("ddp", "fsdp_full", "fsdp_grad_op", "hybrid"),
                   default="ddp")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing per block")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--seed", type=_int_type("--seed", 0), default=0)
    p.add_argument("--log-every", type=_int_type("--log-every", 1), default=10,
                   help="steps per logging window (one host sync per window)")
    p.add_argument("--max-grad-norm", type=float, default=0.0,
                   help="clip the global gradient norm once per optimizer step (0: off)")
    p.add_argument("--no-calibrate", action="store_true",
                   help="skip the window that measures exposed communication and busbw")
    p.add_argument("--num-workers", type=_int_type("--num-workers", 0), default=0,
                   help="DataLoader worker processes per rank")
    p.add_argument("--script", action="store_true",
                   help="treat the file as a plain torchrun script even if it looks like a workload")
    p.add_argument("--run-dir", default=None, help="where this run's files go (default runs/<id>)")
    p.add_argument("--dry-run", action="store_true", help="print the command and start nothing")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def build_parser() -> argparse.ArgumentParser:
    """The full `dlaunch` parser."""
    parser = _Parser(prog="dlaunch", description="Plan, launch and measure distributed PyTorch training.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and torchrun's own log")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    run = sub.add_parser("run", help="launch a workload with torchrun and summarise every rank",
                         description="Launch WORKLOAD with torchrun. Arguments after `--` go to the workload.")
    _add_run_args(run)
    run.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    run.set_defaults(handler=cmd_run)
    insp = sub.add_parser("inspect", help="show this machine's hardware: devices, links, NICs, SLURM",
                          description="Detect this machine (and its SLURM job, if any) and print "
                                      "what the planner will plan for.")
    insp.add_argument("--json", action="store_true", help="print the result as JSON")
    insp.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    insp.set_defaults(handler=cmd_inspect)
    pl = sub.add_parser("plan", help="recommend a strategy, precision and batch settings, and say why",
                        description="Profile WORKLOAD on the meta device and plan it for this machine "
                                    "or a --topology file. Arguments after `--` go to the workload.")
    pl.add_argument("workload", help="workload file (see workloads/)")
    pl.add_argument("--gpus", type=_int_type("--gpus", 1), default=None,
                    help="devices per node (default: all of the topology's)")
    pl.add_argument("--nodes", type=_int_type("--nodes", 1), default=None)
    pl.add_argument("--topology", default=None,
                    help="a topologies/*.yaml name or path (default: detect this machine)")
    pl.add_argument("--global-batch", type=_int_type("--global-batch", 1), default=None,
                    help="samples per optimizer step (default: the largest micro-batch that fits)")
    pl.add_argument("--seq-len", type=_int_type("--seq-len", 1), default=None,
                    help="tokens per sample, for sequence models")
    pl.add_argument("--strategy", choices=("ddp", "fsdp_full", "fsdp_grad_op", "hybrid"), default=None)
    pl.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=None)
    pl.add_argument("--micro-batch", type=_int_type("--micro-batch", 1), default=None)
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    pl.set_defaults(handler=cmd_plan)
    return parser


def _split_workload_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def _detect_device(requested: int) -> str:
    """cuda when this host has the GPUs asked for, cpu when it has none."""
    from launcher.detect import count_gpus

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
    return LaunchSpec(
        workload=args.workload_path, workload_args=tuple(workload_args),
        is_script=is_script, run_id=run_id, run_dir=run_dir, device=device,
        nproc_per_node=args.gpus, steps=args.steps, warmup_steps=warmup,
        micro_batch=args.micro_batch, grad_accum_steps=args.grad_accum, seed=args.seed,
        log_every=args.log_every, calibrate_comm=not args.no_calibrate,
        max_grad_norm=args.max_grad_norm,
        strategy=Strategy(kind=args.strategy, precision=args.precision,
                          activation_checkpointing=args.checkpointing, compile=args.compile),
        loader=LoaderSpec(num_workers=args.num_workers),
    )


def cmd_run(args: argparse.Namespace, workload_args: list[str]) -> int:
    """`dlaunch run`: launch and summarise."""
    from launcher.backends import local
    from launcher.rundir import create_run_dir, new_run_id
    from launcher.workload import inspect_file

    kind = inspect_file(args.workload, force_script=args.script)
    args.workload_path = str(kind.path)
    if args.warmup_steps is not None and args.warmup_steps >= args.steps:
        raise UsageError(f"--warmup-steps must be below --steps ({args.steps}), got {args.warmup_steps}")
    device = _detect_device(args.gpus)
    run_id = new_run_id(args.workload)
    if args.dry_run:
        from launcher.runner import dry_run_text

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
    spec = launch_spec_from_args(args, workload_args, device=device, run_dir=run_dir,
                                 run_id=run_id, is_script=kind.is_script)
    from launcher.runner import run_local

    result = run_local(spec, as_json=args.json, debug=args.debug)
    return result.exit_code if result.exit_code != 0 else (0 if result.status == "ok" else 1)


def cmd_inspect(args: argparse.Namespace, workload_args: list[str]) -> int:
    """`dlaunch inspect`: this machine as a Topology, as text or as JSON."""
    if workload_args:
        raise UsageError(f"dlaunch inspect takes no arguments after `--`, got {' '.join(workload_args)!r}")
    from launcher.detect import detect_topology
    from launcher.inspect_view import format_topology, inspect_report

    topology = detect_topology()
    if args.json:
        print(json.dumps(inspect_report(topology), indent=2))
    else:
        print(format_topology(topology))
    return 0


def cmd_plan(args: argparse.Namespace, workload_args: list[str]) -> int:
    """`dlaunch plan`: the recommended plan, its predicted memory and time, and the rejects."""
    from launcher.planning import plan_workload, resolve_topology
    from launcher.specs import Goal
    from launcher.workload import inspect_file

    inspect_file(args.workload)
    topology = resolve_topology(topology=args.topology, gpus=args.gpus, nodes=args.nodes)
    goal = Goal(global_batch=args.global_batch, seq_len=args.seq_len)
    overrides = {k: v for k, v in (("strategy", args.strategy), ("precision", args.precision),
                                   ("micro_batch", args.micro_batch)) if v is not None}
    planned = plan_workload(args.workload, workload_args, topology, goal, overrides=overrides)
    if args.json:
        print(json.dumps({"plan": planned.plan.to_dict(),
                          "profile": _asdict(planned.profile),
                          "topology": planned.topology.name}, indent=2, default=str))
    else:
        from launcher.planner import format_plan

        print(format_plan(planned.plan, planned.profile, planned.topology))
    for reason in planned.plan.reasons:
        if reason.startswith("warning:"):
            print(f"dlaunch: {reason}", file=sys.stderr)
    return 0


def _asdict(obj: Any) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(obj)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `dlaunch` console script."""
    raw = list(sys.argv[1:] if argv is None else argv)
    own, workload_args = _split_workload_args(raw)
    debug = "--debug" in own
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING,
                        format="dlaunch: %(levelname)s %(name)s: %(message)s")
    if debug:
        os.environ["DLAUNCH_DEBUG"] = "1"
    try:
        parser = build_parser()
        args = parser.parse_args(own)
        if not getattr(args, "command", None):
            parser.print_help()
            return 2
        return int(args.handler(args, workload_args))
    except DlaunchError as e:
        if debug:
            raise
        print(f"dlaunch: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("dlaunch: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

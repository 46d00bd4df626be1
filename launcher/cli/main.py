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
from collections.abc import Sequence
from typing import Any, NoReturn

from launcher.cli.args import int_at_least
from launcher.cli.run import add_run_args, cmd_lab, cmd_run
from launcher.errors import DlaunchError, UsageError

log = logging.getLogger(__name__)


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage, so every error is one line."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def _add_job_ref(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", metavar="RUN_DIR_OR_JOB",
                   help="run dir of a `dlaunch run --slurm`, or its SLURM job id")


def _command(sub: Any, name: str, handler: Any, *, help: str, description: str,
             **defaults: Any) -> argparse.ArgumentParser:
    """One subcommand: its parser, `--debug` accepted after the command too, its handler."""
    p = sub.add_parser(name, help=help, description=description)
    p.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(handler=handler, **defaults)
    return p


def build_parser() -> argparse.ArgumentParser:
    """The full `dlaunch` parser."""
    from launcher.cli.scale import add_report_args, add_scale_args, cmd_report, cmd_scale
    from launcher.cli.slurm import add_slurm_args

    parser = _Parser(prog="dlaunch", description="Plan, launch and measure distributed PyTorch training.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and torchrun's own log")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    run = _command(sub, "run", cmd_run, help="launch a workload with torchrun and summarise every rank",
                   description="Launch WORKLOAD with torchrun. Arguments after `--` go to the workload.")
    add_run_args(run)
    add_slurm_args(run)
    insp = _command(sub, "inspect", cmd_inspect,
                    help="show this machine's hardware: devices, links, NICs, SLURM",
                    description="Detect this machine (and its SLURM job, if any) and print what the "
                                "planner will plan for.")
    insp.add_argument("--json", action="store_true", help="print the result as JSON")
    # plan leaves no child process, thread or open file behind: see `entry`
    pl = _command(sub, "plan", cmd_plan, hard_exit=True,
                  help="recommend a strategy, precision and batch settings, and say why",
                  description="Profile WORKLOAD on the meta device and plan it for this machine or a "
                              "--topology file. Arguments after `--` go to the workload.")
    pl.add_argument("workload", help="workload file (see workloads/)")
    pl.add_argument("--gpus", type=int_at_least("--gpus", 1), default=None,
                    help="devices per node (default: all of the topology's)")
    pl.add_argument("--nodes", type=int_at_least("--nodes", 1), default=None)
    pl.add_argument("--topology", default=None,
                    help="a topologies/*.yaml name or path (default: detect this machine)")
    pl.add_argument("--global-batch", type=int_at_least("--global-batch", 1), default=None,
                    help="samples per optimizer step (default: the largest micro-batch that fits)")
    pl.add_argument("--seq-len", type=int_at_least("--seq-len", 1), default=None,
                    help="tokens per sample, for sequence models")
    pl.add_argument("--strategy", choices=("ddp", "fsdp_full", "fsdp_grad_op", "hybrid"), default=None)
    pl.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=None)
    pl.add_argument("--micro-batch", type=int_at_least("--micro-batch", 1), default=None)
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    add_scale_args(_command(sub, "scale", cmd_scale,
                            help="a scaling sweep: one run per world size, then a report",
                            description="Run WORKLOAD at each world size in --gpus (weak or strong "
                                        "scaling), resumably, then write the report. Arguments after "
                                        "`--` go to the workload."))
    add_report_args(_command(sub, "report", cmd_report,
                             help="HTML/Markdown/JSON/PNG report of a run or sweep directory",
                             description="Scaling efficiency, step-time breakdown, stragglers, busbw "
                                         "and predicted vs measured, as a self-contained HTML page "
                                         "plus PNG/JSON/Markdown."))
    st = _command(sub, "status", cmd_status, help="state, progress and result of a SLURM run",
                  description="Show a SLURM job's state (pending reason), its progress, and the run "
                              "summary once it is over.")
    _add_job_ref(st)
    st.add_argument("--json", action="store_true", help="print the status as JSON")
    lg = _command(sub, "logs", cmd_logs, help="the logs of a SLURM run (every node, or one rank)",
                  description="Print a SLURM job's per-node logs; --rank R keeps rank R's lines.")
    _add_job_ref(lg)
    lg.add_argument("--rank", type=int_at_least("--rank", 0), default=None, help="only this global rank")
    lg.add_argument("--follow", action="store_true", help="keep printing until the job is over")
    _add_job_ref(_command(sub, "cancel", cmd_cancel, help="cancel a SLURM run",
                          description="scancel a SLURM job and wait until it has left the queue."))
    add_run_args(_command(sub, "lab", cmd_lab,
                          help="fp32 / mixed precision / mixed precision + compile, side by side",
                          description="Run WORKLOAD three times back to back (same seed, same data): "
                                      "fp32, the plan's mixed precision, and mixed precision + "
                                      "compile; print throughput, peak memory, the two speed-ups "
                                      "and what they say. Run flags (--gpus, --steps, --strategy, "
                                      "--micro-batch, ...) apply to all three. Arguments after `--` "
                                      "go to the workload."))
    return parser


def _split_workload_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def cmd_inspect(args: argparse.Namespace, workload_args: list[str]) -> int:
    """`dlaunch inspect`: this machine as a Topology, as text or as JSON."""
    if workload_args:
        raise UsageError(f"dlaunch inspect takes no arguments after `--`, got {' '.join(workload_args)!r}")
    from launcher.hardware.detect import detect_topology
    from launcher.hardware.view import format_topology, inspect_report

    topology = detect_topology()
    if args.json:
        print(json.dumps(inspect_report(topology), indent=2))
    else:
        print(format_topology(topology))
    return 0


def cmd_plan(args: argparse.Namespace, workload_args: list[str]) -> int:
    """`dlaunch plan`: the recommended plan, its predicted memory and time, and the rejects."""
    from launcher.plan.resolve import plan_workload, resolve_topology
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
        from launcher.plan.view import format_plan

        print(format_plan(planned.plan, planned.profile, planned.topology))
    for reason in planned.plan.reasons:
        if reason.startswith("warning:"):
            print(f"dlaunch: {reason}", file=sys.stderr)
    return 0


def _no_workload_args(name: str, workload_args: list[str]) -> None:
    if workload_args:
        raise UsageError(f"dlaunch {name} takes no arguments after `--`, got {' '.join(workload_args)!r}")


def cmd_status(args: argparse.Namespace, workload_args: list[str]) -> int:
    """`dlaunch status RUN_DIR_OR_JOB`: a SLURM job's state, progress and summary."""
    _no_workload_args("status", workload_args)
    from launcher.cli.jobs import status

    return status(args.job, as_json=args.json)


def cmd_logs(args: argparse.Namespace, workload_args: list[str]) -> int:
    """`dlaunch logs RUN_DIR_OR_JOB [--rank R] [--follow]`."""
    _no_workload_args("logs", workload_args)
    from launcher.cli.jobs import logs

    return logs(args.job, rank=args.rank, follow=args.follow)


def cmd_cancel(args: argparse.Namespace, workload_args: list[str]) -> int:
    """`dlaunch cancel RUN_DIR_OR_JOB`: scancel and wait until the job left the queue."""
    _no_workload_args("cancel", workload_args)
    from launcher.cli.jobs import cancel

    return cancel(args.job)


def _asdict(obj: Any) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(obj)


def _dispatch(argv: Sequence[str] | None) -> tuple[int, bool]:
    """Parse and run one command: (exit code, whether the command allows a hard exit)."""
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
            return 2, False
        return int(args.handler(args, workload_args)), bool(getattr(args, "hard_exit", False))
    except DlaunchError as e:
        if debug:
            raise
        print(f"dlaunch: error: {e}", file=sys.stderr)
        return e.exit_code, False
    except KeyboardInterrupt:
        print("dlaunch: interrupted", file=sys.stderr)
        return 130, False


def main(argv: Sequence[str] | None = None) -> int:
    """Run one dlaunch command and return its exit code (for callers in Python)."""
    return _dispatch(argv)[0]


def entry() -> NoReturn:
    """Entry point of the `dlaunch` console script and `python -m launcher.cli.main`.

    Once torch (and the torch._dynamo that meta-device profiling imports) is loaded, a normal
    interpreter exit spends ~0.8 s freeing ~3,000 modules: a third of a cold `dlaunch plan`.
    Commands that leave nothing behind (`hard_exit`) skip that teardown after flushing, as
    mypy's hard_exit does; every other command exits normally.
    """
    try:
        code, hard_exit = _dispatch(None)
        if hard_exit:
            sys.stdout.flush()
            sys.stderr.flush()
            logging.shutdown()
            os._exit(code)
    except BrokenPipeError:
        # the reader went away (`dlaunch plan --json | head`): no traceback, exit 1; stdout
        # goes to devnull so the interpreter's own final flush cannot fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 1
    sys.exit(code)


if __name__ == "__main__":
    entry()

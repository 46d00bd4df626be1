"""The `dlaunch` command: the parser wired from the option table, dispatch, exit codes.

Each subcommand's handler lives in its own module, its options in launcher.cli.args. `COMMANDS`
names each handler as a "module:function" string and `_dispatch` imports it only when it runs:
building the parser (every `--help`, every bad-usage error) loads the option table and nothing
of a command's module tree, which tests/unit/test_cli_lazy.py checks and benchmarks/cli_start.py
times. A DlaunchError is one line on stderr (field names put back as flags) and its exit code,
2 for bad input; Ctrl-C, SIGTERM and SIGHUP before the launch one line and 128 + the signal
(`_stop_on_signals`). Must never import torch or matplotlib at start-up: the commands that need
them import them deep inside launcher.plan / launcher.report.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NoReturn, cast

from launcher.cli.args import add_options, name_flags
from launcher.errors import DlaunchError, Interrupted, UsageError

Handler = Callable[[argparse.Namespace, list[str]], int]


@dataclass(frozen=True)
class Command:
    """One subcommand; its options come from launcher.cli.args.OPTIONS."""

    name: str
    handler: str  # "module:function", imported when the command runs, never to build the parser
    help: str  # its line in `dlaunch --help`
    description: str  # atop its own --help
    defaults: Mapping[str, Any] = field(default_factory=dict)  # its parser's defaults
    examples: tuple[str, ...] = ()  # command lines shown at the end of its --help, as typed


_AFTER = "Arguments after `--` go to the workload."
# in `dlaunch --help` order
COMMANDS: tuple[Command, ...] = (
    Command("run", "launcher.cli.run:cmd_run", "launch a workload with torchrun and summarise every rank",
            f"Launch WORKLOAD with torchrun. {_AFTER}", examples=(
                "dlaunch run workloads/gpt.py --gpus 2 -- --size tiny     # planned, then run",
                "dlaunch run train.py --gpus 4 -- --lr 3e-4               # a torchrun script, unchanged",
                "dlaunch run workloads/gpt.py --slurm --nodes 2 --gpus-per-node 8 \\\n"
                "    --topology topologies/h100-sxm-8x4node-ib.yaml -- --size llama3-8b")),
    Command("inspect", "launcher.cli.inspect:cmd_inspect", "show this machine's hardware: devices, links, NICs, SLURM",
            "Detect this machine (and its SLURM job, if any) and print what the planner will plan for."),
    # plan leaves no child process, thread or open file behind: see `entry`
    Command("plan", "launcher.cli.plan:cmd_plan", "recommend a strategy, precision and batch settings, and say why",
            f"Profile WORKLOAD on the meta device and plan it for this machine or a --topology file. {_AFTER}",
            {"hard_exit": True}, examples=(
                "dlaunch plan workloads/gpt.py -- --size tiny",
                "dlaunch plan workloads/gpt.py --topology h100-sxm-8x --tokens 2e12 -- --size llama3-8b",
                "dlaunch plan workloads/hf_causal_lm.py --topology a100-sxm-8x --json -- --config gpt2")),
    Command("scale", "launcher.cli.scale:cmd_scale", "a scaling sweep: one run per world size, then a report",
            "Run WORKLOAD at each world size in --gpus (weak or strong scaling), resumably, then write "
            "the report. Without --strategy, --precision or --micro-batch the plan for the largest "
            f"world size decides them, as in `run`. {_AFTER}", examples=(
                "dlaunch scale workloads/gpt.py --gpus 1,2,4 -- --size tiny",
                "dlaunch scale workloads/gpt.py --gpus 1,2,4 --mode strong --global-batch 32 -- --size tiny")),
    Command("report", "launcher.cli.report:cmd_report", "HTML/Markdown/JSON/PNG report of a run or sweep directory",
            "Scaling efficiency, step-time breakdown, stragglers, busbw and predicted vs measured, as a "
            "self-contained HTML page plus PNG/JSON/Markdown."),
    Command("status", "launcher.cli.runs:cmd_status", "state, progress and result of a run (local or SLURM)",
            "Show a run's state (a local run's owner and heartbeats, a SLURM job's queue state and "
            "pending reason), its progress, and the run summary once it is over."),
    Command("logs", "launcher.cli.runs:cmd_logs", "the logs of a run, local or SLURM (every rank, or one)",
            "Print a run's logs (a local run's rank logs, a SLURM job's per-node logs); --rank R "
            "keeps rank R's lines."),
    Command("cancel", "launcher.cli.runs:cmd_cancel", "stop a running run (local or SLURM)",
            "Stop a run: SIGTERM to a local run's dlaunch (which stops the ranks and writes the "
            "result), scancel for a SLURM job; waits until it has ended."),
    Command("doctor", "launcher.cli.doctor:cmd_doctor",
            "preflight: GEMM, memory and all-reduce per rank and node; name the slow ones",
            "Run one rank per device (CPU: --gpus processes with gloo) on this host, or on every node of a SLURM job "
            "with --slurm: each times a GEMM in the plan's precision, a large copy and all-reduces. Prints measured / "
            "expected per rank and node, where each expected figure comes from, and names every rank and node below "
            "--threshold of the median (exit 1) with a ready --exclude list."),
    Command("lab", "launcher.cli.lab:cmd_lab", "fp32 / mixed precision / mixed precision + compile, side by side",
            "Run WORKLOAD three times back to back (same seed, same data): fp32, the plan's mixed precision, and mixed "
            "precision + compile; print throughput, peak memory, the two speed-ups and what they say. Run flags "
            f"(--gpus, --steps, --strategy, --micro-batch, ...) apply to all three. {_AFTER}"),
    Command("tune", "launcher.cli.tune:cmd_tune", "measure the plan's near-best candidates, keep the fastest, learn",
            "Plan WORKLOAD, run each candidate predicted within the model's uncertainty of the best (at most --trials) "
            "for a short trial, write the fastest as tuned-plan.json (for `dlaunch run --plan`) and store the "
            f"measured/predicted ratios for later plans on this machine. {_AFTER}"),
)


def load_handler(path: str) -> Handler:
    """The handler a `Command` names ("launcher.cli.run:cmd_run"), importing its module now."""
    module, _, name = path.partition(":")
    return cast(Handler, getattr(importlib.import_module(module), name))


# torchrun's own flags, as users type them out of habit: what dlaunch says instead
TORCHRUN_HABITS = {
    "--nproc-per-node": "use --gpus N (processes per node)",
    "--nproc_per_node": "use --gpus N (processes per node)",
    "--nnodes": "use --slurm --nodes N (one torchrun per node)",
    "--node-rank": "use --slurm --nodes N (each node's torchrun gets its rank)",
    "--node_rank": "use --slurm --nodes N (each node's torchrun gets its rank)",
    "--master-port": "not needed: dlaunch picks the rendezvous (loopback, or a port from the SLURM job)",
    "--master_port": "not needed: dlaunch picks the rendezvous (loopback, or a port from the SLURM job)",
    "--master-addr": "not needed: dlaunch picks the rendezvous (loopback, or the job's first node)",
    "--master_addr": "not needed: dlaunch picks the rendezvous (loopback, or the job's first node)",
    "--rdzv-endpoint": "not needed: dlaunch picks the rendezvous (loopback, or the job's first node)",
    "--standalone": "not needed: a single-node run already rendezvouses on loopback",
}


def unrecognized(extra: Sequence[str], *, takes_workload: bool, prog: str) -> str:
    """The one line for arguments no option takes: a torchrun flag's dlaunch spelling, or the
    `--` that hands arguments to a workload."""
    line = f"unrecognized arguments: {' '.join(extra)} ("
    for arg in extra:
        flag = arg.split("=", 1)[0]
        if flag in TORCHRUN_HABITS:
            return line + f"{flag} is torchrun's: {TORCHRUN_HABITS[flag]}; see {prog} --help)"
    if takes_workload:
        line += f"arguments for the workload go after `--`: {prog} WORKLOAD [options] -- {' '.join(extra)}; "
    return line + f"see {prog} --help)"


# a negative number as argparse should see it: a value, never an option. Its own pattern
# (-1, -.5) misses scientific notation, so `--tokens -1e12` read as a missing argument instead of
# reaching the option's check (which says what the value must be); no dlaunch flag looks like one
_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage, so every error is one line, and takes
    negative numbers as values (`_NEGATIVE_NUMBER`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = _NEGATIVE_NUMBER

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


class _Formatter(argparse.HelpFormatter):
    """argparse's help, with the examples kept as written (command lines must not be reflowed)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("examples:"):
            return "".join(indent + line + "\n" for line in text.splitlines())
        return super()._fill_text(text, width, indent)


class _Version(argparse.Action):
    """`dlaunch --version`: the installed package's version, looked up only when asked (the
    metadata machinery is not on the start-up path of every command)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print dlaunch's version and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        import importlib.metadata

        try:
            version = importlib.metadata.version("dlaunch")
        except importlib.metadata.PackageNotFoundError:
            version = "(not installed: run from a checkout)"
        print(f"dlaunch {version}")
        parser.exit(0)


def build_parser() -> argparse.ArgumentParser:
    """The full `dlaunch` parser."""
    parser = _Parser(prog="dlaunch", description="Plan, launch and measure distributed PyTorch training.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks, torchrun's log, libraries' warnings")
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for command in COMMANDS:
        examples = "examples:\n" + "\n".join(f"  {e}" for e in command.examples) if command.examples else None
        p = sub.add_parser(command.name, help=command.help, description=command.description,
                           epilog=examples, formatter_class=_Formatter)
        p.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)  # after the command too
        p.set_defaults(handler=command.handler, **command.defaults)  # the handler's name, not yet imported
        add_options(p, command.name)
    return parser


# a kill, `timeout`, a scheduler (SIGTERM) or a closed terminal (SIGHUP) stops dlaunch as Ctrl-C
# does; while a job runs the backend relays them to the job (backends.local._catch_interrupts)
_STOPPING = (signal.SIGTERM, signal.SIGHUP)


def _raise_interrupted(signum: int, frame: object) -> NoReturn:
    raise Interrupted(signum)


@contextmanager
def _stop_on_signals() -> Iterator[None]:
    """Turn SIGTERM and SIGHUP into `Interrupted` (a KeyboardInterrupt) while the body runs, so
    they unwind as Ctrl-C does: probe children ended, temp dirs removed, one line. A signal the
    caller ignores (`nohup`) stays ignored; only the main thread catches any (`main` may run in another)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.getsignal(s) for s in _STOPPING}
    for s, h in old.items():
        if h is not signal.SIG_IGN:
            signal.signal(s, _raise_interrupted)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _dlaunch_or_error(record: logging.LogRecord) -> bool:  # the log filter without --debug
    return record.name.startswith("launcher.") or record.levelno >= logging.ERROR


def _dispatch(argv: Sequence[str] | None) -> tuple[int, bool]:
    """Parse and run one command: (exit code, whether the command allows a hard exit)."""
    raw = list(sys.argv[1:] if argv is None else argv)
    cut = raw.index("--") if "--" in raw else len(raw)  # what follows `--` goes to the workload
    own, workload_args = raw[:cut], raw[cut + 1:]
    debug = "--debug" in own
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING,
                        format="dlaunch: %(levelname)s %(name)s: %(message)s")
    if debug:
        os.environ["DLAUNCH_DEBUG"] = "1"
    # others' records (a workload's, profiled here) are not dlaunch's: their errors only; added once per handler
    (logging.root.handlers[0].removeFilter if debug else logging.root.handlers[0].addFilter)(_dlaunch_or_error)
    try:
        with _stop_on_signals():  # restored before the line below is printed
            parser = build_parser()
            args, extra = parser.parse_known_args(own)
            if extra:
                command = getattr(args, "command", None)
                raise UsageError(unrecognized(extra, takes_workload=hasattr(args, "workload"),
                                              prog=f"dlaunch {command}" if command else "dlaunch"))
            if not getattr(args, "command", None):
                parser.print_help()
                return 2, False
            if workload_args and not hasattr(args, "workload"):  # a command that runs no workload
                raise UsageError(f"dlaunch {args.command} takes no arguments after `--`, "
                                 f"got {' '.join(workload_args)!r}")
            handler = load_handler(args.handler)  # only now: this command's module tree, no other's
            return int(handler(args, workload_args)), bool(getattr(args, "hard_exit", False))
    except DlaunchError as e:
        if debug:  # the traceback too; the exit code stays the error's
            traceback.print_exc()
        print(f"dlaunch: error: {name_flags(str(e))}", file=sys.stderr)
        return e.exit_code, False
    except Interrupted as e:  # SIGTERM, SIGHUP
        print(f"dlaunch: {e.line()}", file=sys.stderr)
        return e.exit_code, False
    except KeyboardInterrupt:
        print("dlaunch: interrupted", file=sys.stderr)
        return 130, False


def main(argv: Sequence[str] | None = None) -> int:
    """Run one dlaunch command and return its exit code (for callers in Python)."""
    return _dispatch(argv)[0]


def entry() -> NoReturn:
    """Entry point of the `dlaunch` console script and `python -m launcher.cli.main`. Once torch
    (and torch._dynamo) is loaded, a normal interpreter exit spends ~0.8 s freeing ~3,000
    modules: a third of a cold `dlaunch plan`. Commands that leave nothing behind (`hard_exit`)
    skip that teardown after flushing, as mypy's hard_exit does."""
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

"""Every option of every `dlaunch` command, declared once in `OPTIONS`, and what follows from it.

From the table come the argparse arguments of each command (`add_options`), the dlaunch.yaml
keys (`yaml_keys`, which launcher.cli.config reads against), the one merge "flag > dlaunch.yaml >
default" (`resolve`), the flags that mean nothing without --slurm, and the flag names put into
error lines in place of the field names the specs and the request use (`name_flags`). What an
option is (`Option`, `Yaml`) and the argparse types are in launcher.cli.option.

The merged dict `resolve` returns is read only by launcher.cli.options, which types it (one
frozen dataclass per command); command modules read those, never the dict. This module must
never import launcher.cli.config or launcher.cli.options (which import it), a command module,
the request, or anything that imports torch. Every command's parser is built from this table
at start-up, `dlaunch --help` included, so at import time it loads only launcher.cli.option,
launcher.errors and launcher.specs: the few values it shows that belong to heavier modules (the
sweep's modes, the tune's trial length) are stated here, each beside its owner's name
(tests/unit/test_cli_lazy.py checks that they agree), and the one function it needs from the
SLURM backend is imported when it runs.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Mapping
from typing import Any

from launcher.cli.option import Option, Parse, Yaml, at_least, minutes, real
from launcher.errors import UsageError
from launcher.specs import (
    CHECKPOINTING,
    COMPILE_MODES,
    DEFAULT_TIME_MIN,
    PRECISIONS,
    STRATEGIES,
    SWEEP_MODES,
    TRACKERS,
    TRIAL_STEPS,
    TRIAL_TIMED_S,
)

RUN = ("run", "lab")  # the flags of one run apply to each of the lab's three
_SLURM = ("run", "scale", "tune", "doctor")  # the commands that submit SLURM jobs
TUNE_TRIALS = 4  # candidates a tune measures at most
# a doctor job takes about a minute; a short limit backfills sooner (submitit needs > 10 min)
DOCTOR_TIME_MIN = 15.0
SLURM_GROUP = "SLURM (with --slurm; defaults from dlaunch.yaml's slurm: section)"
# read by launcher.cli.placement, which refuses more CPU processes than this without --force
CPU_PROCESSES_PER_CORE = 4  # beyond this a CPU run or sweep measures contention, not scaling
MODES = SWEEP_MODES


def _slurm_text(what: str) -> Yaml:
    return Yaml(section="slurm", types=(str,), what=what)


def _fraction(flag: str) -> Parse:
    """An argparse `type` accepting a fraction in (0, 1] (`--threshold 0.8`), naming the flag."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise UsageError(f"{flag} must be a fraction in (0, 1], e.g. 0.8, got {text!r}") from None
        if not 0 < value <= 1:  # NaN fails too
            raise UsageError(f"{flag} must be a fraction in (0, 1], e.g. 0.8, got {text}")
        return value

    return parse


def _number(flag: str, *, minimum: float, inclusive: bool) -> Parse:
    """An argparse `type` accepting a finite number above `minimum` (or at it, `inclusive`)."""
    bound = f">= {minimum:g}" if inclusive else f"> {minimum:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise UsageError(f"{flag} must be a number {bound}, got {text!r}") from None
        if not math.isfinite(value) or value < minimum or (value == minimum and not inclusive):
            raise UsageError(f"{flag} must be a finite number {bound}, got {text}")
        return value

    return parse


def _trackers(flag: str) -> Parse:
    """An argparse `type` accepting a comma-separated subset of TRACKERS."""

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
        unknown = [n for n in names if n not in TRACKERS]
        if unknown or not names:
            raise UsageError(f"{flag} takes a comma-separated list of {', '.join(TRACKERS)}, got {text!r}")
        return names

    return parse


def _non_negative(flag: str) -> Parse:
    return _number(flag, minimum=0.0, inclusive=True)


def _positive(flag: str) -> Parse:
    return _number(flag, minimum=0.0, inclusive=False)


def _merge_slurm_opts(given: list[str] | None, configured: Mapping[str, str] | None) -> tuple[tuple[str, str], ...]:
    # `--slurm-opt` items are laid over dlaunch.yaml's `opts`, key by key. Imported here, when a
    # command resolves its options: the submit module loads the SLURM backend (task, torchrun
    # argv, run dir): a quarter of the old start-up time, which no parser needs
    from launcher.backends.slurm.submit import parse_slurm_opts

    return parse_slurm_opts(given or [], configured or {})


_WORKLOAD = "workload file (see workloads/)"
OPTIONS: tuple[Option, ...] = (
    Option("workload", commands=(*RUN, "plan", "scale", "tune"), help=f"{_WORKLOAD} or a plain torchrun script",
           per={"plan": {"help": _WORKLOAD}, "scale": {"help": _WORKLOAD}, "tune": {"help": _WORKLOAD}}),
    Option("path", commands=("report",), metavar="DIR",
           help="a run, sweep or tune directory"),
    Option("job", commands=("status", "logs", "cancel"), metavar="RUN_DIR_OR_JOB",
           help="run dir of a `dlaunch run --slurm`, or its SLURM job id"),
    Option("--gpus", commands=(*RUN, "plan", "scale", "tune", "doctor"), parse=at_least(1), default=1,
           aliases=("nproc_per_node",),
           help="processes per node: GPUs, or CPU processes when there is no GPU",
           per={"plan": {"default": None, "help": "devices per node (default: all of the topology's)"},
                "scale": {"parse": None, "default": None, "required": True, "metavar": "N,N,...",
                          "help": "world sizes to run, comma-separated (e.g. 1,2,4,8)"},
                "doctor": {"default": None, "help": "ranks per node: one per GPU (default: every GPU), "
                                                    "or CPU processes with gloo when there is no GPU "
                                                    "(default 2)"}}),
    Option("--mode", commands=("scale",), choices=MODES, default="weak",
           help="weak: keep --micro-batch per rank; strong: keep --global-batch"),
    Option("--steps", commands=(*RUN, "scale", "tune"), parse=at_least(1), default=20, help="optimizer steps",
           per={"scale": {"help": "optimizer steps per run"},
                "tune": {"default": None, "help": f"optimizer steps per trial (default: {TRIAL_STEPS}, or more "
                                                  f"to time {TRIAL_TIMED_S:g} s of the fastest candidate's steps)"}}),
    Option("--warmup-steps", commands=(*RUN, "scale", "tune"), parse=at_least(0),
           help="steps left out of throughput (default: min(3, steps - 1))"),
    Option("--micro-batch", commands=(*RUN, "plan", "scale"), parse=at_least(1),
           help="samples per rank per forward pass (default: the plan's)",
           per={"scale": {"help": "samples per rank per forward pass, kept in weak scaling "
                                  "(default: the plan's)"}}),
    Option("--grad-accum", commands=(*RUN, "scale"), parse=at_least(1), aliases=("grad_accum_steps",),
           help="micro-batches per optimizer step (default: the plan's)",
           per={"scale": {"help": "micro-batches per optimizer step (default: the plan's; 1 with "
                                  "--mode strong)"}}),
    Option("--global-batch", commands=(*RUN, "plan", "scale", "tune"), parse=at_least(1),
           help="samples per optimizer step for the plan (default: its choice)",
           per={"plan": {"help": "samples per optimizer step (default: the largest micro-batch "
                                 "that fits)"},
                "scale": {"help": "samples per optimizer step for --mode strong (every world size "
                                  "must divide it)"}}),
    Option("--seq-len", commands=("plan",), parse=at_least(1),
           help="tokens per sample, for sequence models"),
    Option("--strategy", commands=(*RUN, "plan", "scale"), choices=STRATEGIES, help="default: the plan's"),
    Option("--precision", commands=(*RUN, "plan", "scale", "doctor"), choices=PRECISIONS, help="default: the plan's",
           per={"doctor": {"help": "the GEMM's dtype (default: bf16 on GPUs of compute capability >= 8.0, "
                                   "else fp32; fp32 on CPUs)"}}),
    Option("--checkpointing", commands=(*RUN, "plan", "scale"), choices=CHECKPOINTING,
           help="activation checkpointing of the workload's blocks: none; selective (per op: "
                "matmul and attention outputs saved, the rest recomputed); every-other (every "
                "second block recomputed whole); full (every block) (default: the plan's)"),
    Option("--compile", commands=(*RUN, "plan", "scale"), kind="toggle",
           help="torch.compile the model (default: the plan's: on for GPUs where Dynamo traces the "
                "workload without a graph break, off on CPUs)"),
    Option("--compile-mode", commands=RUN, choices=COMPILE_MODES,
           help="torch.compile mode (implies --compile; default: default)"),
    Option("--compile-strict", commands=RUN, kind="switch",
           help="fullgraph=True, and a compile failure fails the run instead of falling back to "
                "eager (implies --compile)"),
    Option("--quiet", commands=("run",), kind="switch",
           help="no live progress line (step, throughput, ETA, measured vs planned step time)"),
    Option("--log-to", commands=("run",), parse=_trackers, default=(), metavar="TRACKERS",
           help="also log the run's metrics (rank 0's loss, step time, throughput per step; "
                "result.json's summary) to these trackers, comma-separated: "
                f"{', '.join(TRACKERS)} (needs the tracker's package; see docs/commands.md)"),
    Option("--tp", commands=(*RUN, "plan", "scale"), parse=at_least(1),
           help="tensor-parallel degree: ranks of one node that split every block's matmuls "
                "(DTensor, sequence parallel), FSDP sharding over the rest; needs the workload's "
                "tp_plan(model, tp) (default: the plan's; 1 on CPUs)"),
    Option("--shard-group-size", commands=RUN, parse=at_least(1),
           help="hybrid shard: ranks per shard group (default: the ranks of a node)"),
    Option("--profile", commands=RUN, kind="switch",
           help="torch.profiler over 3 steps after warm-up: trace-rank<r>.json per rank and the "
                "top operators in the summary"),
    Option("--memory-snapshot", commands=RUN, kind="switch",
           help="CUDA only: record allocations, dump memory-rank<r>.pickle at the end or on "
                "out-of-memory"),
    Option("--detect-anomaly", commands=RUN, kind="switch",
           help="autograd anomaly detection: find the op that makes NaNs (slow)"),
    Option("--stop-on-nan", commands=RUN, kind="switch",
           help="end the run (failed) at the first NaN or infinite loss; without it, a warning"),
    Option("--eval-every", commands=RUN, parse=at_least(0), default=0,
           help="run the workload's evaluate(model, cfg) after every N optimizer steps (0: never)"),
    Option("--seed", commands=(*RUN, "scale", "tune"), parse=at_least(0), default=0),
    Option("--log-every", commands=RUN, parse=at_least(1), default=0,
           help="steps per logging window (one host sync and one all-reduce of the losses per "
                "window; default: 10, or as many as take 0.5 s when 10 steps take less)"),
    Option("--max-grad-norm", commands=RUN, parse=_non_negative, default=0.0,
           help="clip the global gradient norm once per optimizer step (0: off)"),
    Option("--no-calibrate", commands=RUN, kind="switch",
           help="skip the window that measures exposed communication and busbw"),
    Option("--num-workers", commands=(*RUN, "scale", "tune"), parse=at_least(0), default=0,
           help="DataLoader worker processes per rank"),
    Option("--script", commands=RUN, kind="switch",
           help="treat the file as a plain torchrun script even if it looks like a workload"),
    Option("--run-dir", commands=(*RUN, "doctor"), help="where this run's files go (default runs/<id>)",
           per={"doctor": {"help": "where the ranks' files and doctor.json go (default runs/doctor-<id>)"}}),
    Option("--repeat", commands=("scale",), parse=at_least(1), default=1, help="runs per world size"),
    Option("--sweep-dir", commands=("scale",),
           help="where the sweep goes (default runs/scale-<workload>-<mode>-<hash>: the same "
                "command resumes the same sweep)"),
    Option("--force", commands=(*RUN, "scale", "tune", "doctor"), kind="switch",
           help=f"start more CPU processes than {CPU_PROCESSES_PER_CORE} per usable core",
           per={"scale": {"help": "re-run points that already finished"}}),
    Option("--plan", commands=("run", "scale"), metavar="FILE",
           help="follow this plan (a tune dir's tuned-plan.json, or a run dir's plan.json): its "
                "strategy, precision, micro-batch, accumulation, checkpointing and compile; flags "
                "given beside it win"),
    Option("--no-calibration-cache", commands=("plan",), kind="switch",
           help="ignore this machine's step-time corrections learnt by `dlaunch tune`"),
    Option("--tokens", commands=("plan",), parse=_positive, metavar="N",
           help="a training goal in tokens (e.g. 2e12): the plan adds time to train, GPU-hours, "
                "goodput and (with a price) cost"),
    Option("--samples", commands=("plan",), parse=_positive, metavar="N",
           help="a training goal in samples (instead of --tokens)"),
    Option("--train-steps", commands=("plan",), parse=_positive, metavar="N",
           help="a training goal in optimizer steps (instead of --tokens)"),
    Option("--gpu-hour-price", commands=("plan",), parse=_non_negative, metavar="PRICE",
           help="price of one GPU-hour, for the cost of a training goal"),
    Option("--world-sizes", commands=("plan",), metavar="N,N,...",
           help="plan at each of these GPU counts (nodes = N / GPUs per node) and print one "
                "table: strategy, step time, throughput, efficiency, and with a goal days, "
                "GPU-hours, cost, goodput"),
    Option("--deadline", commands=("plan",), metavar="DURATION",
           help="with --world-sizes and a goal: the cheapest size that trains within it (30d, 12h)"),
    Option("--budget", commands=("plan",), parse=_positive, metavar="AMOUNT",
           help="with --world-sizes and a goal: the fastest size within it (the price's currency "
                "with --gpu-hour-price, else GPU-hours)"),
    Option("--mtbf-gpu-hours", commands=("plan",), parse=_positive, metavar="H",
           help="GPU-hours between interruptions (default: Llama 3's published rate, ~50,700)"),
    Option("--ckpt-write-gb-s", commands=("plan",), parse=_positive, metavar="GB_S",
           help="checkpoint storage write bandwidth per node in GB/s (default 2, an assumption)"),
    Option("--threshold", commands=("doctor",), parse=_fraction, default=0.8,
           help="a rank (node) below this fraction of the median rank's (node's) rate is SLOW "
                "(default 0.8)"),
    Option("--trials", commands=("tune",), parse=at_least(1), default=TUNE_TRIALS,
           help=f"at most this many candidates measured (default {TUNE_TRIALS})"),
    Option("--budget-min", commands=("tune",), parse=minutes,
           help="start no further trial once this many minutes have gone (default: no limit)"),
    Option("--tune-dir", commands=("tune",),
           help="where the trials' run dirs and tuned-plan.json go (default runs/tune-<id>)"),
    Option("--no-report", commands=("scale",), kind="switch", help="do not write the report at the end"),
    Option("--format", commands=("report",), default="html,md,json,png",
           help="comma-separated: html, md, json, png (default all)"),
    Option("--out", commands=("report",), help="output directory (default DIR/report)"),
    Option("--no-predict", commands=("report",), kind="switch", help="skip the planner's prediction"),
    Option("--rank", commands=("logs",), parse=at_least(0), help="only this global rank"),
    Option("--follow", commands=("logs",), kind="switch", help="keep printing until the job is over"),
    Option("--dry-run", commands=(*RUN, "scale", "tune", "doctor"), kind="switch",
           help="print the command and start nothing",
           per={"scale": {"help": "print the points and commands, run nothing"},
                "tune": {"help": "print each trial's command (with --slurm its sbatch script) and start nothing"}}),
    Option("--json", commands=(*RUN, "plan", "scale", "tune", "report", "inspect", "status", "doctor"),
           kind="switch",
           help="print the result as JSON",
           per={"plan": {"help": "print the plan as JSON"},
                "scale": {"help": "print the sweep and report as JSON"},
                "report": {"help": "print the report's numbers as JSON"},
                "status": {"help": "print the status as JSON"}}),
    Option("--hang-timeout-s", commands=RUN, parse=real, default=300.0,
           help="end the job when no rank advanced for this long (0: never); the collective "
                "timeout is twice this (default 300)"),
    Option("--startup-timeout-s", commands=RUN, parse=real,
           help="allowance before every rank finished step 1: imports, model build, compile, "
                "rendezvous (default max(900, --hang-timeout-s))"),
    Option("--max-restarts", commands=RUN, parse=at_least(0), default=0,
           help="relaunch a failed job up to N times (fresh rendezvous, same run dir); it resumes "
                "from the last checkpoint (see --checkpoint-every)"),
    Option("--checkpoint-every", commands=RUN, parse=at_least(0), default=0,
           help="save a checkpoint (torch.distributed.checkpoint, RUN_DIR/checkpoints) every N "
                "optimizer steps (0: only on the preemption signal); restarts and SLURM requeues "
                "resume from the newest with the same data order"),
    # -- SLURM: `run --slurm`, `scale --slurm` and `tune --slurm`
    Option("--slurm", commands=_SLURM, kind="switch", slurm_in=_SLURM,
           help="submit to SLURM (submitit): one task per node, each running torchrun",
           per={"scale": {"help": "run each point as a SLURM job (one per world size and repeat)"},
                "doctor": {"help": "check every node of a SLURM job: one torchrun per node, followed "
                                   "like `run --slurm`"},
                "tune": {"help": "run each trial as its own SLURM job, one after another, followed like "
                                 "`run --slurm` (needs --topology of the partition's nodes)"}}),
    Option("--nodes", commands=("run", "plan", "tune", "doctor"), parse=at_least(1),
           slurm_in=("run", "tune", "doctor"),
           aliases=("num_nodes",),
           help="nodes (default 1)", per={"plan": {"help": "nodes to plan for (default: the topology's)"}}),
    Option("--gpus-per-node", commands=_SLURM, parse=at_least(1), slurm_in=_SLURM,
           help="processes (GPUs) per node; same as --gpus",
           per={"scale": {"help": "processes (GPUs) per node: a point of N ranks runs on N / this "
                                  "many nodes (default: the partition's GPUs per node, or CPUs per "
                                  "node without GPUs)"}}),
    Option("--partition", commands=_SLURM, slurm_in=_SLURM,
           yaml=_slurm_text("a partition name"), help="SLURM partition (default: the cluster's default)"),
    Option("--account", commands=_SLURM, slurm_in=_SLURM,
           yaml=_slurm_text("an account name")),
    Option("--qos", commands=_SLURM, slurm_in=_SLURM, yaml=_slurm_text("a QOS name")),
    Option("--constraint", commands=_SLURM, slurm_in=_SLURM,
           yaml=_slurm_text("a node feature expression"), help="node features, e.g. a100"),
    Option("--time-min", commands=_SLURM, parse=minutes, default=DEFAULT_TIME_MIN,
           slurm_in=_SLURM, yaml=Yaml(section="slurm", types=(int, float), what="minutes (a number > 0)"),
           help=f"job time limit in minutes (default {DEFAULT_TIME_MIN:g})",
           per={"doctor": {"default": DOCTOR_TIME_MIN,
                           "help": f"job time limit in minutes (default {DOCTOR_TIME_MIN:g})"}}),
    Option("--cpus-per-node", commands=_SLURM, parse=at_least(1), slurm_in=_SLURM,
           yaml=Yaml(section="slurm", types=(int,), what="an integer >= 1"),
           help="CPUs to request per node (default: the partition's CPUs per node)"),
    Option("--slurm-opt", commands=_SLURM, kind="list", metavar="KEY=VALUE", slurm_in=_SLURM,
           yaml=Yaml(section="slurm", types=(dict,), what="a mapping of sbatch option -> value", name="opts"),
           merge=_merge_slurm_opts, help="extra sbatch option, e.g. --slurm-opt mem=64G (repeatable)"),
    Option("--queue-timeout-min", commands=_SLURM, parse=minutes, slurm_in=_SLURM,
           yaml=Yaml(section="slurm", types=(int, float), what="minutes (a number > 0)"),
           help="cancel the job if it is still pending after this many minutes"),
    Option("--detach", commands=("run",), kind="switch", slurm_in=("run",),
           help="print the job id and run dir and return (see dlaunch status/logs/cancel)"),
    Option("--topology", commands=("run", "plan", "scale", "tune", "report", "doctor"), metavar="FILE",
           slurm_in=("run", "tune"),
           yaml=Yaml(section="slurm", types=(str,), what="a topology file describing the partition's nodes"),
           help="the partition's nodes (topologies/*.yaml) for the plan; without it a SLURM run is "
                "not planned (this login node says nothing about the compute nodes)",
           per={"plan": {"metavar": None,
                         "help": "a topologies/*.yaml name or path (default: detect this machine)"},
                "scale": {"metavar": None,
                          "help": "topology file or name: link bandwidth and predictions (default: "
                                  "detect); with --slurm the partition's nodes, for the plan too"},
                "tune": {"help": "the partition's nodes (topologies/*.yaml), which the trials' candidates "
                                 "are planned for: needed with --slurm"},
                "report": {"metavar": None,
                           "help": "topology file or name: link bandwidth and predictions (default: "
                                   "the one the sweep recorded, or this machine when it ran the job)"},
                "doctor": {"metavar": None,
                           "help": "judge against this topology's listed figures (default: this host: "
                                   "detected GPUs, or the CPU's cached probe; with --slurm: none, the "
                                   "ranks and nodes against each other only)"}}),
)


def options_of(command: str) -> list[Option]:
    """The options `command` takes, as it declares them, in table order."""
    return [o.for_command(command) for o in OPTIONS if command in o.commands]


def add_options(parser: argparse.ArgumentParser, command: str) -> None:
    """Add `command`'s options to its parser. Flags default to None, so `resolve` can tell a
    flag given on the command line from one left out."""
    group: Any = None
    for opt in options_of(command):
        if command in opt.slurm_in:
            group = group or parser.add_argument_group(SLURM_GROUP)
            target: Any = group
        else:
            target = parser
        kw: dict[str, Any] = {"help": opt.help or None}
        if opt.positional:
            target.add_argument(opt.flag, metavar=opt.metavar, **kw)
            continue
        if opt.kind == "switch":
            kw.update(action="store_true", default=None)
        elif opt.kind == "toggle":
            kw.update(action=argparse.BooleanOptionalAction, default=None)
        else:
            kw.update(action="append" if opt.kind == "list" else "store", default=None,
                      metavar=opt.metavar, choices=opt.choices, required=opt.required,
                      type=opt.parse(opt.flag) if opt.parse else None)
        target.add_argument(opt.flag, **kw)


def resolve(command: str, args: argparse.Namespace, configured: Mapping[str, Any]) -> dict[str, Any]:
    """Every option of `command` by dest: the flag when given, else its dlaunch.yaml value
    (`configured`, by `yaml_key`), else its default. A SLURM flag without --slurm is refused."""
    slurm = bool(getattr(args, "slurm", None))
    values: dict[str, Any] = {}
    for opt in options_of(command):
        given = getattr(args, opt.dest, None)
        if given is not None and command in opt.slurm_in and opt.dest != "slurm" and not slurm:
            raise UsageError(f"{opt.flag} needs --slurm (a local run uses this machine only)")
        from_yaml = configured.get(opt.yaml_key) if opt.yaml_key else None
        if opt.merge is not None:
            values[opt.dest] = opt.merge(given, from_yaml)
        elif given is not None:
            values[opt.dest] = given
        elif from_yaml is not None:
            values[opt.dest] = from_yaml
        else:
            values[opt.dest] = False if opt.kind == "switch" and opt.default is None else opt.default
    return values


def yaml_keys() -> dict[str, tuple[Yaml, Parse | None]]:
    """Every dlaunch.yaml key: its declaration and the flag's parser (to range-check values)."""
    return {o.yaml_key: (o.yaml, o.parse(o.flag) if o.parse else None)
            for o in OPTIONS if o.yaml is not None and o.yaml_key is not None}


def name_flags(message: str) -> str:
    """`message` with each backticked field name (`micro_batch`) replaced by its flag: specs and
    the request name fields, and the command line speaks in flags."""
    names = {name: o.flag for o in OPTIONS if not o.positional for name in (o.dest, *o.aliases)}
    return re.sub(r"`([a-z_]+)`", lambda m: names.get(m.group(1), m.group(0)), message)


def no_extra_args(command: str, extra: list[str]) -> None:
    """Commands that run no workload take nothing after `--`."""
    if extra:
        raise UsageError(f"dlaunch {command} takes no arguments after `--`, got {' '.join(extra)!r}")

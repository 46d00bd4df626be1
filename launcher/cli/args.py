"""Every option of every `dlaunch` command, declared once in `OPTIONS`, and what follows from it.

From the table come the argparse arguments of each command (`add_options`), the dlaunch.yaml
keys (`yaml_keys`), the one merge "flag > dlaunch.yaml > default" (`resolve`, whose dict only
launcher.cli.options reads: command modules read its typed dataclasses), the flags that mean
nothing without --slurm, and the flag names put into error lines in place of the field names the
specs and the request use (`name_flags`). What an option is: launcher.cli.option.

Must never import launcher.cli.config or launcher.cli.options (which import it), a command
module, the request, or anything that imports torch: every parser is built from this table at
start-up, `dlaunch --help` included, so at import time it loads only the foundation
(tests/unit/test_cli_lazy.py checks); the SLURM backend's one function is imported when it runs.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping
from typing import Any

from launcher.cli.option import Option, Parse, Yaml, knob_option
from launcher.errors import UsageError
from launcher.knobs import FRACTION, MAX_GLOBAL_BATCH, MINUTES, at_least, non_negative, positive
from launcher.runspec import MAX_GPUS, MAX_NODES
from launcher.specs import DEFAULT_TIME_MIN, SWEEP_MODES, TRACKERS, TRIAL_STEPS, TRIAL_TIMED_S

RUN = ("run", "lab")  # the flags of one run apply to each of the lab's three
_SLURM = ("run", "scale", "tune", "doctor")  # the commands that submit SLURM jobs
TUNE_TRIALS = 4  # candidates a tune measures at most
# a doctor job takes about a minute; a short limit backfills sooner (submitit needs > 10 min)
DOCTOR_TIME_MIN = 15.0
SLURM_GROUP = "SLURM (with --slurm; defaults from dlaunch.yaml's slurm: section)"
# the local backend's placement (launcher.backends.host, via cli.prepare) refuses more without --force
CPU_PROCESSES_PER_CORE = 4  # beyond this a CPU run or sweep measures contention, not scaling
GOAL_MAX = 1e18  # a goal no real run reaches: 25,000x the largest published pre-training (36T tokens)
# launcher.cli.prepare's MAX_STEP_S and MAX_RUN_S, which --force passes (tests/unit/test_cli_lazy.py)
_ABSURD = "a day per step or a year in all"


def _slurm_text(what: str) -> Yaml:
    return Yaml(section="slurm", types=(str,), what=what)


def _trackers(flag: str) -> Parse:
    """An argparse `type` accepting a comma-separated subset of TRACKERS."""

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
        unknown = [n for n in names if n not in TRACKERS]
        if unknown or not names:
            raise UsageError(f"{flag} takes a comma-separated list of {', '.join(TRACKERS)}, got {text!r}")
        return names

    return parse


def _merge_slurm_opts(given: list[str] | None, configured: Mapping[str, str] | None) -> tuple[tuple[str, str], ...]:
    # `--slurm-opt` items laid over dlaunch.yaml's `opts`, key by key. Imported when a command
    # resolves its options: the registry loads the backends, which no parser needs. The CLI
    # reaches SLURM's parser through the registry, never launcher.backends.slurm (test_imports.py)
    from launcher.backends.registry import parse_slurm_opts

    return parse_slurm_opts(given or [], configured or {})


_WORKLOAD = "workload file (see workloads/)"
OPTIONS: tuple[Option, ...] = (
    Option("workload", commands=(*RUN, "plan", "scale", "tune"), help=f"{_WORKLOAD} or a plain torchrun script",
           per={"plan": {"help": _WORKLOAD}, "scale": {"help": _WORKLOAD}, "tune": {"help": _WORKLOAD}}),
    Option("path", commands=("report",), metavar="DIR", help="a run, sweep or tune directory"),
    Option("job", commands=("status", "logs", "cancel"), metavar="RUN_DIR_OR_JOB",
           help="run dir of a `dlaunch run --slurm`, or its SLURM job id"),
    knob_option("gpus", commands=(*RUN, "plan", "scale", "tune", "doctor"),
           per={"plan": {"default": None, "help": "devices per node (default: all of the topology's)"},
                "scale": {"check": None, "default": None, "required": True, "metavar": "N,N,...",
                          "help": "world sizes to run, comma-separated (e.g. 1,2,4,8)"},
                "doctor": {"default": None, "help": "ranks per node: one per GPU (default: every GPU), or CPU "
                                                    "processes with gloo when there is no GPU (default 2)"}}),
    Option("--mode", commands=("scale",), choices=SWEEP_MODES, default="weak",
           help="weak: keep --micro-batch per rank; strong: keep --global-batch"),
    knob_option("steps", commands=(*RUN, "scale", "tune"),
           per={"scale": {"help": "optimizer steps per run"},
                "tune": {"default": None, "help": f"optimizer steps per trial (default: {TRIAL_STEPS}, or more "
                                                  f"to time {TRIAL_TIMED_S:g} s of the fastest candidate's steps)"}}),
    knob_option("warmup_steps", commands=(*RUN, "scale", "tune")),
    knob_option("micro_batch", commands=(*RUN, "plan", "scale"),
           per={"scale": {"help": "samples per rank per forward pass, kept in weak scaling (default: the plan's)"}}),
    knob_option("grad_accum", commands=(*RUN, "scale"),
           per={"scale": {"help": "micro-batches per optimizer step (default: the plan's; 1 with --mode strong)"}}),
    Option("--global-batch", commands=(*RUN, "plan", "scale", "tune"), check=at_least(1, MAX_GLOBAL_BATCH),
           help="samples per optimizer step for the plan (default: its choice)",
           per={"plan": {"help": "samples per optimizer step (default: the largest micro-batch that fits)"},
                "scale": {"help": "samples per optimizer step for --mode strong (every world size must divide it)"}}),
    Option("--seq-len", commands=("plan",), check=at_least(1, 10**8), help="tokens per sample, for sequence models"),
    knob_option("strategy", commands=(*RUN, "plan", "scale")),
    knob_option("precision", commands=(*RUN, "plan", "scale", "doctor"),
           per={"doctor": {"help": "the GEMM's dtype (default: bf16 on GPUs of compute capability >= 8.0, "
                                   "else fp32; fp32 on CPUs)"}}),
    *(knob_option(name, commands=(*RUN, "plan", "scale")) for name in ("checkpointing", "compile")),
    *(knob_option(name, commands=RUN) for name in ("compile_mode", "compile_strict")),
    Option("--quiet", commands=("run",), kind="switch",
           help="no live progress line (step, throughput, ETA, measured vs planned step time)"),
    Option("--log-to", commands=("run",), parse=_trackers, default=(), metavar="TRACKERS",
           help="also log the run's metrics (rank 0's loss, step time, throughput per step; "
                "result.json's summary) to these trackers, comma-separated: "
                f"{', '.join(TRACKERS)} (needs the tracker's package; see docs/commands.md)"),
    *(knob_option(name, commands=(*RUN, "plan", "scale")) for name in ("tp", "offload", "float8", "fsdp_unit")),
    *(knob_option(name, commands=(*RUN, "plan", "scale", "tune"))
      for name in ("reduce_dtype", "attention_kernel", "loss_kernel", "norm_kernel")),
    *(knob_option(name, commands=RUN) for name in (
        "shard_group_size", "profile", "memory_snapshot", "detect_anomaly", "stop_on_nan", "eval_every")),
    knob_option("seed", commands=(*RUN, "scale", "tune")),
    *(knob_option(name, commands=RUN) for name in ("log_every", "max_grad_norm", "calibrate")),
    knob_option("num_workers", commands=(*RUN, "scale", "tune")),
    Option("--script", commands=RUN, kind="switch",
           help="treat the file as a plain torchrun script even if it looks like a workload"),
    Option("--run-dir", commands=(*RUN, "doctor"), help="where this run's files go (default runs/<id>)",
           per={"doctor": {"help": "where the ranks' files and doctor.json go (default runs/doctor-<id>)"}}),
    Option("--repeat", commands=("scale",), check=at_least(1, 1000), default=1, help="runs per world size"),
    Option("--sweep-dir", commands=("scale",),
           help="where the sweep goes (default runs/scale-<workload>-<mode>-<hash>: the same "
                "command resumes the same sweep)"),
    Option("--force", commands=(*RUN, "scale", "tune", "doctor"), kind="switch",
           help=f"start more CPU processes than {CPU_PROCESSES_PER_CORE} per usable core, or a launch "
                f"its plan predicts will run out of memory or take over {_ABSURD}",
           per={"scale": {"help": "re-run points that already finished; launch a sweep its plan "
                                  f"predicts will run out of memory or take over {_ABSURD}"},
                "doctor": {"help": f"start more CPU processes than {CPU_PROCESSES_PER_CORE} per usable core"}}),
    Option("--plan", commands=("run", "scale"), metavar="FILE",
           help="follow this plan (a tune dir's tuned-plan.json, or a run dir's plan.json): its strategy, "
                "precision, micro-batch, accumulation, checkpointing and compile; flags given beside it win"),
    Option("--no-calibration-cache", commands=("plan",), kind="switch",
           help="ignore this machine's step-time corrections learnt by `dlaunch tune`"),
    Option("--tokens", commands=("plan",), check=positive(GOAL_MAX), metavar="N",
           help="a training goal in tokens (e.g. 2e12): the plan adds time to train, GPU-hours, "
                "goodput and (with a price) cost"),
    Option("--samples", commands=("plan",), check=positive(GOAL_MAX), metavar="N",
           help="a training goal in samples (instead of --tokens)"),
    Option("--train-steps", commands=("plan",), check=positive(1e12), metavar="N",
           help="a training goal in optimizer steps (instead of --tokens)"),
    Option("--gpu-hour-price", commands=("plan",), check=non_negative(1e6), metavar="PRICE",
           help="price of one GPU-hour, for the cost of a training goal"),
    Option("--world-sizes", commands=("plan",), metavar="N,N,...",
           help="plan at each of these GPU counts (nodes = N / GPUs per node) and print one table: "
                "strategy, step time, throughput, efficiency, and with a goal days, GPU-hours, cost, goodput"),
    Option("--deadline", commands=("plan",), metavar="DURATION",
           help="with --world-sizes and a goal: the cheapest size that trains within it (30d, 12h)"),
    Option("--budget", commands=("plan",), check=positive(1e15), metavar="AMOUNT",
           help="with --world-sizes and a goal: the fastest size within it (the price's currency "
                "with --gpu-hour-price, else GPU-hours)"),
    Option("--mtbf-gpu-hours", commands=("plan",), check=positive(1e9), metavar="H",
           help="GPU-hours between interruptions (default: Llama 3's published rate, ~50,700)"),
    Option("--ckpt-write-gb-s", commands=("plan",), check=positive(1e6), metavar="GB_S",
           help="checkpoint storage write bandwidth per node in GB/s (default 2, an assumption)"),
    Option("--threshold", commands=("doctor",), check=FRACTION, default=0.8,
           help="a rank (node) below this fraction of the median rank's (node's) rate is SLOW (default 0.8)"),
    Option("--trials", commands=("tune",), check=at_least(1, 1000), default=TUNE_TRIALS,
           help=f"at most this many candidates measured (default {TUNE_TRIALS})"),
    Option("--budget-min", commands=("tune",), check=MINUTES,
           help="start no further trial once this many minutes have gone (default: no limit)"),
    Option("--tune-dir", commands=("tune",),
           help="where the trials' run dirs and tuned-plan.json go (default runs/tune-<id>)"),
    Option("--no-report", commands=("scale",), kind="switch", help="do not write the report at the end"),
    Option("--format", commands=("report",), default="html,md,json,png",
           help="comma-separated: html, md, json, png (default all)"),
    Option("--out", commands=("report",), help="output directory (default DIR/report)"),
    Option("--no-predict", commands=("report",), kind="switch", help="skip the planner's prediction"),
    Option("--rank", commands=("logs",), check=at_least(0, MAX_GPUS * MAX_NODES), help="only this global rank"),
    Option("--follow", commands=("logs",), kind="switch", help="keep printing until the job is over"),
    Option("--dry-run", commands=(*RUN, "scale", "tune", "doctor"), kind="switch",
           help="print the command and start nothing",
           per={"scale": {"help": "print the points and commands, run nothing"},
                "tune": {"help": "print each trial's command (with --slurm its sbatch script) and start nothing"}}),
    Option("--json", commands=(*RUN, "plan", "scale", "tune", "report", "inspect", "status", "doctor"),
           kind="switch", help="print the result as JSON",
           per={"plan": {"help": "print the plan as JSON"}, "scale": {"help": "print the sweep and report as JSON"},
                "report": {"help": "print the report's numbers as JSON"},
                "status": {"help": "print the status as JSON"}}),
    *(knob_option(name, commands=RUN) for name in (
        "hang_timeout_s", "startup_timeout_s", "max_restarts", "checkpoint_every")),
    # -- SLURM: `run --slurm`, `scale --slurm` and `tune --slurm`
    Option("--slurm", commands=_SLURM, kind="switch", slurm_in=_SLURM,
           help="submit to SLURM (submitit): one task per node, each running torchrun",
           per={"scale": {"help": "run each point as a SLURM job (one per world size and repeat)"},
                "doctor": {"help": "check every node of a SLURM job: one torchrun per node, followed "
                                   "like `run --slurm`"},
                "tune": {"help": "run each trial as its own SLURM job, one after another, followed like "
                                 "`run --slurm` (needs --topology of the partition's nodes)"}}),
    knob_option("nodes", commands=("run", "plan", "tune", "doctor"), slurm_in=("run", "tune", "doctor"),
                per={"plan": {"default": None, "help": "nodes to plan for (default: the topology's)"},
                     "doctor": {"default": None}}),
    Option("--gpus-per-node", commands=_SLURM, check=at_least(1, MAX_GPUS), slurm_in=_SLURM,
           help="processes (GPUs) per node; same as --gpus",
           per={"scale": {"help": "processes (GPUs) per node: a point of N ranks runs on N / this many nodes "
                                  "(default: the partition's GPUs per node, or CPUs per node without GPUs)"}}),
    Option("--partition", commands=_SLURM, slurm_in=_SLURM,
           yaml=_slurm_text("a partition name"), help="SLURM partition (default: the cluster's default)"),
    Option("--account", commands=_SLURM, slurm_in=_SLURM, yaml=_slurm_text("an account name"),
           help="SLURM account to charge (default: your default account)"),
    Option("--qos", commands=_SLURM, slurm_in=_SLURM, yaml=_slurm_text("a QOS name"),
           help="SLURM quality of service (default: the partition's)"),
    Option("--constraint", commands=_SLURM, slurm_in=_SLURM,
           yaml=_slurm_text("a node feature expression"), help="node features, e.g. a100"),
    Option("--time-min", commands=_SLURM, check=MINUTES, default=DEFAULT_TIME_MIN,
           slurm_in=_SLURM, yaml=Yaml(section="slurm", types=(int, float), what="minutes (a number > 0)"),
           help=f"job time limit in minutes (default {DEFAULT_TIME_MIN:g})",
           per={"doctor": {"default": DOCTOR_TIME_MIN,
                           "help": f"job time limit in minutes (default {DOCTOR_TIME_MIN:g})"}}),
    Option("--cpus-per-node", commands=_SLURM, check=at_least(1, 10**6), slurm_in=_SLURM,
           yaml=Yaml(section="slurm", types=(int,), what="an integer >= 1"),
           help="CPUs to request per node (default: the partition's CPUs per node)"),
    Option("--slurm-opt", commands=_SLURM, kind="list", metavar="KEY=VALUE", slurm_in=_SLURM,
           yaml=Yaml(section="slurm", types=(dict,), what="a mapping of sbatch option -> value", name="opts"),
           merge=_merge_slurm_opts, help="extra sbatch option, e.g. --slurm-opt mem=64G (repeatable)"),
    Option("--queue-timeout-min", commands=_SLURM, check=MINUTES, slurm_in=_SLURM,
           yaml=Yaml(section="slurm", types=(int, float), what="minutes (a number > 0)"),
           help="cancel the job if it is still pending after this many minutes"),
    Option("--detach", commands=("run",), kind="switch", slurm_in=("run",),
           help="print the job id and run dir and return (see dlaunch status/logs/cancel)"),
    Option("--topology", commands=("run", "plan", "scale", "tune", "report", "doctor"), metavar="FILE",
           slurm_in=("run", "tune"),
           yaml=Yaml(section="slurm", types=(str,), what="a topology file describing the partition's nodes"),
           help="the partition's nodes (topologies/*.yaml) for the plan; without it a SLURM run is "
                "not planned (this login node says nothing about the compute nodes)",
           per={"plan": {"metavar": None, "help": "a topologies/*.yaml name or path (default: detect this machine)"},
                "scale": {"metavar": None, "help": "topology file or name: link bandwidth and predictions (default: "
                                                   "detect); with --slurm the partition's nodes, for the plan too"},
                "tune": {"help": "the partition's nodes (topologies/*.yaml), which the trials' candidates "
                                 "are planned for: needed with --slurm"},
                "report": {"metavar": None, "help": "topology file or name: link bandwidth and predictions (default: "
                                                    "the one the sweep recorded, or this machine when it ran the job)"},
                "doctor": {"metavar": None, "help": "judge against this topology's listed figures (default: this host: "
                                                    "detected GPUs, or the CPU's cached probe; with --slurm: none, "
                                                    "the ranks and nodes against each other only)"}}),
)


def options_of(command: str) -> list[Option]:
    """The options `command` takes, as it declares them, in table order."""
    return [o.for_command(command) for o in OPTIONS if command in o.commands]


def add_options(parser: argparse.ArgumentParser, command: str) -> None:
    """Add `command`'s options to its parser; flags default to None so `resolve` sees which were given."""
    group: Any = None
    for opt in options_of(command):
        if command in opt.slurm_in:
            group = group or parser.add_argument_group(SLURM_GROUP)
        target: Any = group if command in opt.slurm_in else parser
        kw: dict[str, Any] = {"help": opt.help or None}
        if opt.help and "default" not in opt.help and not any(opt.default is v for v in (None, False, ())):
            shown = f"{opt.default:g}" if isinstance(opt.default, float) else opt.default
            kw["help"] += f" (default: {shown})"
        if opt.help and opt.check is not None and opt.check.high is not None and opt.check.high > 1:
            kw["help"] += f" (at most {opt.check.bound()})"  # the bound, said where it is declared
        if opt.positional:
            kw.update(metavar=opt.metavar)
        elif opt.kind == "switch":
            kw.update(action="store_true", default=None)
        elif opt.kind == "toggle":
            kw.update(action=argparse.BooleanOptionalAction, default=None)
        else:
            kw.update(action="append" if opt.kind == "list" else "store", default=None, metavar=opt.metavar,
                      choices=opt.choices, required=opt.required, type=opt.argparse_type)
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
        default = False if opt.kind == "switch" and opt.default is None else opt.default
        if opt.merge is not None:
            values[opt.dest] = opt.merge(given, from_yaml)
        else:  # the flag, else dlaunch.yaml's value, else the default
            values[opt.dest] = next((v for v in (given, from_yaml) if v is not None), default)
    return values


def yaml_keys() -> dict[str, tuple[Yaml, Parse | None]]:
    """Every dlaunch.yaml key: its declaration and the flag's parser (to range-check values)."""
    return {o.yaml_key: (o.yaml, o.argparse_type) for o in OPTIONS if o.yaml is not None and o.yaml_key is not None}


def name_flags(message: str) -> str:
    """`message` with each backticked field name (`micro_batch`) replaced by its flag: specs and
    the request name fields, and the command line speaks in flags."""
    names = {o.dest: o.flag for o in OPTIONS if not o.positional}
    return re.sub(r"`([a-z_][a-z0-9_]*)`", lambda m: names.get(m.group(1), m.group(0)), message)

"""Each command's resolved options as a frozen, typed dataclass, and the one step that builds it.

`launcher.cli.args.OPTIONS` stays the one place an option is declared; this module types and
groups the resolved values: one dataclass per command (`BUILDS`), the SLURM group shared as
`SlurmOptions` (None without --slurm, so a local run cannot read a SLURM setting by mistake). A
field is named after its option's dest, so `typed` is a plain copy out of the merged dict;
tests/unit/test_options_typed.py checks that fields and table agree, option for option and type
for type. `load` is the merge a command calls. Imported by command modules only, never to build
the parser: dlaunch.yaml's reader and the plan-file reader are imported when `load` runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from launcher.cli.args import resolve
from launcher.knobs import knobs_of
from launcher.runspec import RunSettings
from launcher.specs import linear_units_ok

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


@dataclass(frozen=True, kw_only=True)
class SlurmOptions:
    """The SLURM group of run, scale, tune and doctor: given only with --slurm."""

    gpus_per_node: int | None  # processes (GPUs) per node; None: --gpus, or the partition's
    partition: str | None  # None: the cluster's default partition
    account: str | None  # SLURM account to charge
    qos: str | None  # quality of service
    constraint: str | None  # node features, e.g. a100
    time_min: float  # job time limit in minutes
    cpus_per_node: int | None  # None: the partition's CPUs per node (sinfo)
    slurm_opt: tuple[tuple[str, str], ...]  # extra sbatch options, --slurm-opt over dlaunch.yaml's
    queue_timeout_min: float | None  # cancel when still pending after this long; None: never


@dataclass(frozen=True, kw_only=True)
class Options:
    """What every command's options share: the command that builds them (`BUILDS` checks it)."""

    command: ClassVar[str]


@dataclass(frozen=True, kw_only=True)
class LabOptions(Options):
    """The flags of one run on this host: all of `dlaunch lab`'s, which applies them to each of its
    three runs; `dlaunch run` takes these and more (`RunOptions`)."""

    command: ClassVar[str] = "lab"
    workload: str  # the workload file or plain torchrun script, as given
    settings: RunSettings  # the run's knobs, as given (the plan's decisions None when not)
    global_batch: int | None  # samples per optimizer step, a goal for the plan; None: its choice
    script: bool  # a plain torchrun script even if the file looks like a workload
    run_dir: str | None  # where the run's files go; None: runs/<id>
    force: bool  # allow more CPU processes per core, and a launch its plan calls absurd (prepare.refuse_absurd)
    dry_run: bool  # print the command, start nothing
    json: bool  # print the result as JSON


@dataclass(frozen=True, kw_only=True)
class RunOptions(LabOptions):
    """`dlaunch run`: one run's flags, a plan file to follow, and where on SLURM it runs."""

    command: ClassVar[str] = "run"
    plan: str | None  # a plan file whose decisions fill those the flags left open
    detach: bool  # submit, print the job id and return
    quiet: bool  # no live progress line
    log_to: tuple[str, ...]  # trackers the launcher logs the run's metrics to (results.trackers)
    topology: str | None  # a topology file of the partition's nodes, for the plan
    slurm: SlurmOptions | None  # None: this host


@dataclass(frozen=True, kw_only=True)
class PlanOptions(Options):
    """`dlaunch plan`: the goal, the decisions given, and the machine to plan for."""

    command: ClassVar[str] = "plan"
    workload: str  # the workload file
    gpus: int | None  # devices per node; None: the topology's
    nodes: int | None  # nodes; None: the topology's
    topology: str | None  # a topologies/*.yaml name or path; None: detect this machine
    settings: RunSettings  # the decisions given (None: the planner's)
    global_batch: int | None  # samples per optimizer step; None: the largest micro-batch that fits
    seq_len: int | None  # tokens per sample, for sequence models
    no_calibration_cache: bool  # ignore the step-time corrections learnt by `dlaunch tune`
    json: bool  # print the plan as JSON
    tokens: float | None  # a training goal in tokens; None: no time to train
    samples: float | None  # a training goal in samples
    train_steps: float | None  # a training goal in optimizer steps
    gpu_hour_price: float | None  # per GPU-hour; None: no cost
    mtbf_gpu_hours: float | None  # None: Llama 3's published interruption rate
    ckpt_write_gb_s: float | None  # per node; None: the assumed 2 GB/s
    world_sizes: str | None  # GPU counts to plan side by side, as given ("64,128"); None: one plan
    deadline: str | None  # a duration as given ("30d"); None: no deadline
    budget: float | None  # cost (with a price) or GPU-hours; None: no budget


@dataclass(frozen=True, kw_only=True)
class ScaleOptions(Options):
    """`dlaunch scale`: the sweep (world sizes, mode, repeats, its dir) and the flags of its runs."""

    command: ClassVar[str] = "scale"
    workload: str  # the workload file
    gpus: str  # world sizes, comma-separated, as given ("1,2,4")
    mode: str  # weak: keep the micro-batch per rank; strong: keep the global batch
    repeat: int  # runs per world size
    sweep_dir: str | None  # None: runs/scale-<workload>-<mode>-<hash>
    no_report: bool  # do not write the report at the end
    settings: RunSettings  # the knobs of every point, as given
    global_batch: int | None  # strong scaling's samples per optimizer step
    plan: str | None  # a plan file whose decisions fill those the flags left open
    force: bool  # re-run points that already finished; launch a sweep its plan calls absurd
    dry_run: bool  # print the points and commands, run nothing
    json: bool  # print the sweep and report as JSON
    topology: str | None  # link bandwidth and predictions (with --slurm: the partition's nodes)
    slurm: SlurmOptions | None  # None: this host


@dataclass(frozen=True, kw_only=True)
class TuneOptions(Options):
    """`dlaunch tune`: how many trials, how long, where they go, and the flags of each."""

    command: ClassVar[str] = "tune"
    workload: str  # the workload file
    settings: RunSettings  # the knobs of every trial, as given
    steps: int | None  # optimizer steps per trial; None: long enough to time the fastest
    warmup_steps: int | None  # None: min(3, steps - 1)
    global_batch: int | None  # a goal for the plan; None: its choice
    trials: int  # candidates measured at most
    budget_min: float | None  # start no trial after this many minutes; None: no limit
    tune_dir: str | None  # None: runs/tune-<id>
    force: bool  # allow more CPU processes per core, and a launch its plan calls absurd (prepare.refuse_absurd)
    dry_run: bool  # print each trial's command, start nothing
    json: bool  # print the result as JSON
    topology: str | None  # the partition's nodes, which the candidates are planned for
    slurm: SlurmOptions | None  # None: this host


@dataclass(frozen=True, kw_only=True)
class DoctorOptions(Options):
    """`dlaunch doctor`: where the ranks run, the GEMM's precision, and the verdict's threshold."""

    command: ClassVar[str] = "doctor"
    gpus: int | None  # ranks per node; None: every GPU, or 2 CPU ranks
    nodes: int | None  # SLURM nodes; None: 1
    precision: str | None  # the GEMM's dtype; None: the rank picks
    threshold: float  # below this fraction of the median rate is SLOW
    topology: str | None  # judge against this topology's figures; None: this host's
    run_dir: str | None  # None: runs/doctor-<id>
    force: bool  # allow more CPU processes than launcher.cli.args.CPU_PROCESSES_PER_CORE per core
    dry_run: bool  # print the command, start nothing
    json: bool  # print the report as JSON
    slurm: SlurmOptions | None  # None: this host


@dataclass(frozen=True, kw_only=True)
class ReportOptions(Options):
    """`dlaunch report DIR`: which directory, which formats, where they go."""

    command: ClassVar[str] = "report"
    path: str  # a run, sweep or tune directory
    format: str  # comma-separated formats, as given
    out: str | None  # None: DIR/report
    no_predict: bool  # skip the planner's prediction
    topology: str | None  # None: the recorded one, or this machine when it ran the job
    json: bool  # print the report's numbers as JSON


@dataclass(frozen=True, kw_only=True)
class InspectOptions(Options):
    """`dlaunch inspect`."""

    command: ClassVar[str] = "inspect"
    json: bool  # print the topology as JSON


@dataclass(frozen=True, kw_only=True)
class StatusOptions(Options):
    """`dlaunch status RUN_DIR_OR_JOB`."""

    command: ClassVar[str] = "status"
    job: str  # a run dir or a SLURM job id
    json: bool  # print the status as JSON


@dataclass(frozen=True, kw_only=True)
class LogsOptions(Options):
    """`dlaunch logs RUN_DIR_OR_JOB`."""

    command: ClassVar[str] = "logs"
    job: str  # a run dir or a SLURM job id
    rank: int | None  # only this global rank; None: every node's log
    follow: bool  # keep printing until the job is over


@dataclass(frozen=True, kw_only=True)
class CancelOptions(Options):
    """`dlaunch cancel RUN_DIR_OR_JOB`."""

    command: ClassVar[str] = "cancel"
    job: str  # a run dir or a SLURM job id


BUILDS: Mapping[str, type[Options]] = {cls.command: cls for cls in (
    RunOptions, LabOptions, PlanOptions, ScaleOptions, TuneOptions, DoctorOptions, ReportOptions,
    InspectOptions, StatusOptions, LogsOptions, CancelOptions)}

T = TypeVar("T", bound=Options)
D = TypeVar("D", bound="DataclassInstance")  # a dataclass of options: a command's, or a group of it


def nested(cls: type[Any]) -> dict[str, type[Any]]:
    """The fields of `cls` that hold a dataclass of options (`slurm`), by name: present when the
    switch of the same dest is on, None when it is off."""
    out: dict[str, type[Any]] = {}
    for name, hint in typing.get_type_hints(cls).items():
        inner = [a for a in typing.get_args(hint) if isinstance(a, type) and dataclasses.is_dataclass(a)
                 and a is not RunSettings]
        if inner:
            out[name] = inner[0]
    return out


def typed(cls: type[D], values: Mapping[str, Any]) -> D:
    """`cls` filled from the merged options by dest; its `settings` takes the run knobs the command
    has no field of its own for (made, so checked, here: before anything is planned)."""
    groups = nested(cls)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name == "settings":
            own = {g.name for g in dataclasses.fields(cls)}
            fields[f.name] = RunSettings(**{k: values[k] for k in knobs_of(RunSettings)
                                            if k in values and k not in own})
        elif f.name in groups:
            fields[f.name] = typed(groups[f.name], values) if values[f.name] else None
        else:
            fields[f.name] = values[f.name]
    return cls(**fields)


def load(cls: type[T], args: argparse.Namespace) -> T:
    """The options of `cls.command`, typed: flag > dlaunch.yaml (read for --slurm only) > default,
    then `--plan FILE`'s decisions for those the flags left open."""
    from launcher.cli.config import load_config  # yaml: loaded when a command runs, never for --help

    values = resolve(cls.command, args, load_config().values if getattr(args, "slurm", None) else {})
    if values.get("plan"):  # its decisions for those the flags left open (a flag given beside it wins)
        from launcher.drivers.tune import read_plan_file

        decided = read_plan_file(values["plan"])
        given = {k for k, v in values.items() if v is not None}
        values.update({k: v for k, v in decided.items() if k != "compile" and values.get(k) is None})
        values["compile"] = bool(decided["compile"]) if values.get("compile") is None else values["compile"]
        # the plan's linear units yield to a flag given beside it that they cannot run with (LINEAR_UNITS_NEED)
        if "fsdp_unit" not in given and values.get("fsdp_unit") == "linear" and not linear_units_ok(
                strategy=values.get("strategy"), tp=values.get("tp"), compile=values["compile"],
                checkpointing=values.get("checkpointing")):
            values["fsdp_unit"] = None
    return typed(cls, values)

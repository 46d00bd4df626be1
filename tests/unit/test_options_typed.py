"""The typed options (launcher.cli.options) against the option table (launcher.cli.args.OPTIONS):
every field of a command's dataclass is one of that command's declared options with the type
the table gives it, every declared option has its field, and loading fills them with values of
those types."""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

import pytest

from launcher.cli.args import options_of
from launcher.cli.main import build_parser
from launcher.cli.option import COMMANDS, Option
from launcher.cli.options import BUILDS, RunOptions, ScaleOptions, SlurmOptions, load, nested
from launcher.errors import UsageError
from launcher.knobs import knobs_of
from launcher.runspec import RunSettings

# a minimal command line of each command
ARGV: dict[str, list[str]] = {
    "run": ["run", "w.py"], "lab": ["lab", "w.py"], "plan": ["plan", "w.py"],
    "scale": ["scale", "w.py", "--gpus", "1,2"], "tune": ["tune", "w.py"], "report": ["report", "d"],
    "inspect": ["inspect"], "status": ["status", "1"], "logs": ["logs", "1"], "cancel": ["cancel", "1"],
    "doctor": ["doctor"],
}


def _members(hint: Any) -> set[Any]:
    """The types a hint admits: `int | None` -> {int, NoneType}; tuple[...] -> {tuple}."""
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union \
        else (hint,)
    return {typing.get_origin(a) or a for a in args}


def _declared_type(opt: Option) -> set[Any]:
    """The types the table lets `opt` resolve to (its flag's parser, its kind, its default)."""
    if opt.positional:
        return {str}
    if opt.kind == "switch":
        return {bool}
    if opt.kind == "toggle":
        return {bool} if isinstance(opt.default, bool) else {bool, type(None)}
    if opt.kind == "list":
        base: type[Any] = tuple if opt.merge is not None else list
    elif opt.parse and isinstance(opt.default, tuple):  # a list in one value (--log-to a,b)
        base = tuple
    else:
        base = opt.check.kind if opt.check else str
    optional = opt.default is None and not opt.required and opt.merge is None
    return {base, type(None)} if optional else {base}


def _fields(cls: type[Any]) -> dict[str, Any]:
    """Every leaf field of `cls` by name, its nested groups opened (their own field kept too), and
    its `settings` opened into the run knobs its command takes and has no field of its own for."""
    hints = typing.get_type_hints(cls)
    taken = {o.dest for o in options_of(cls.command)} if hasattr(cls, "command") else set()
    own = {f.name for f in dataclasses.fields(cls)}
    out = {}
    for f in dataclasses.fields(cls):
        if f.name == "settings":
            knob_hints = typing.get_type_hints(RunSettings)
            out.update({k: knob_hints[k] for k in knobs_of(RunSettings) if k in taken and k not in own})
            continue
        out[f.name] = hints[f.name]
        if f.name in nested(cls):
            out.update(_fields(nested(cls)[f.name]))
    return out


def test_every_command_builds_its_own_dataclass():
    assert sorted(BUILDS) == sorted(COMMANDS)
    for command, cls in BUILDS.items():
        assert cls.command == command
        params = getattr(cls, "__dataclass_params__")
        assert params.frozen, cls
        assert all(f.kw_only for f in dataclasses.fields(cls)), cls


@pytest.mark.parametrize("command", COMMANDS)
def test_fields_are_the_declared_options_with_their_types(command: str):
    declared = {o.dest: o for o in options_of(command)}
    fields = _fields(BUILDS[command])
    assert set(fields) == set(declared), command  # none missing, none invented
    for name, hint in fields.items():
        opt = declared[name]
        if name in nested(BUILDS[command]):  # a group: present exactly when its switch is on
            assert opt.kind == "switch" and _members(hint) == {nested(BUILDS[command])[name], type(None)}
            continue
        assert _members(hint) == _declared_type(opt), f"{command} {opt.flag}: {hint}"


def test_each_group_is_declared_by_every_command_that_holds_it():
    holders = [c for c, cls in BUILDS.items() if "slurm" in nested(cls)]
    assert sorted(holders) == ["doctor", "run", "scale", "tune"]
    for command in holders:
        slurm_in = {o.dest for o in options_of(command) if command in o.slurm_in}
        assert {f.name for f in dataclasses.fields(SlurmOptions)} <= slurm_in, command


def _admits(hint: Any, value: Any) -> bool:
    allowed = _members(hint)
    if float in allowed and isinstance(value, int) and not isinstance(value, bool):
        return True  # dlaunch.yaml's `time_min: 30`
    return any(isinstance(value, t) for t in allowed)


@pytest.mark.parametrize("command", COMMANDS)
def test_loading_fills_every_field_with_its_type(command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    opts = load(BUILDS[command], build_parser().parse_args(ARGV[command]))
    hints = typing.get_type_hints(type(opts))
    for f in dataclasses.fields(opts):
        assert _admits(hints[f.name], getattr(opts, f.name)), (command, f.name, getattr(opts, f.name))
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(opts, dataclasses.fields(opts)[0].name, None)


def test_slurm_group_is_none_without_slurm_and_merged_with_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dlaunch.yaml").write_text("slurm:\n  partition: from-yaml\n  time_min: 30\n  opts:\n    mem: 4G\n")
    local = load(RunOptions, build_parser().parse_args(["run", "w.py"]))
    assert local.slurm is None and local.settings.steps == 20 and local.settings.gpus == 1 and local.json is False
    given = load(RunOptions, build_parser().parse_args(
        ["run", "w.py", "--slurm", "--qos", "q", "--slurm-opt", "gres=gpu:1", "--nodes", "2"]))
    assert given.slurm == SlurmOptions(gpus_per_node=None, partition="from-yaml", account=None, qos="q",
                                       constraint=None, time_min=30, cpus_per_node=None,
                                       slurm_opt=(("gres", "gpu:1"), ("mem", "4G")), queue_timeout_min=None)
    assert given.settings.nodes == 2
    sweep = load(ScaleOptions, build_parser().parse_args(["scale", "w.py", "--gpus", "1,2,4", "--mode", "strong"]))
    assert sweep.gpus == "1,2,4" and sweep.mode == "strong" and sweep.slurm is None
    with pytest.raises(UsageError, match="--partition needs --slurm"):
        load(RunOptions, build_parser().parse_args(["run", "w.py", "--partition", "gpu"]))


def test_a_plan_file_fills_the_decisions_the_flags_left_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    plan = tmp_path / "tuned-plan.json"
    plan.write_text('{"decisions": {"strategy": "fsdp_full", "precision": "bf16", "micro_batch": 4, '
                    '"grad_accum": 2, "checkpointing": true, "compile": false}}')
    opts = load(RunOptions, build_parser().parse_args(["run", "w.py", "--plan", str(plan), "--micro-batch", "8"]))
    given = opts.settings
    assert (given.strategy, given.precision, given.micro_batch, given.grad_accum) == ("fsdp_full", "bf16", 8, 2)
    # a plan file from before the checkpointing modes: true is every block
    assert given.checkpointing == "full" and given.compile is False
    # tensor parallelism and the kernels it was planned with travel too, a flag beside them wins
    plan.write_text('{"decisions": {"strategy": "fsdp_full", "precision": "bf16", "micro_batch": 4, '
                    '"grad_accum": 2, "checkpointing": "none", "compile": false, "tp": 2, '
                    '"attention_kernel": "fa2", "loss_kernel": "fused"}}')
    opts = load(RunOptions, build_parser().parse_args(["run", "w.py", "--plan", str(plan), "--loss-kernel", "eager"]))
    given = opts.settings
    assert (given.tp, given.attention_kernel, given.loss_kernel, given.norm_kernel) == (2, "fa2", "eager", None)
    # its linear units travel, and yield to a flag beside them they cannot run with (DDP, TP, compile)
    plan.write_text('{"decisions": {"strategy": "fsdp_full", "precision": "bf16", "micro_batch": 4, '
                    '"grad_accum": 2, "checkpointing": "none", "compile": false, "fsdp_unit": "linear"}}')
    for flags, unit in (((), "linear"), (("--strategy", "ddp"), None), (("--compile",), None), (("--tp", "2"), None),
                        (("--checkpointing", "selective"), None)):
        given = load(RunOptions, build_parser().parse_args(["run", "w.py", "--plan", str(plan), *flags])).settings
        assert given.fsdp_unit == unit, flags

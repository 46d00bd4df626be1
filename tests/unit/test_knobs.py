"""One declaration and one name per knob: every run knob is a field of RunSettings declared with
`knob()` (flag, help, unit, check), and the option table, the typed options, the request and
LaunchSpec (so launch.json) all derive from it; the old spellings live only in the migration."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re

import pytest

from launcher.cli.args import OPTIONS, add_options
from launcher.cli.main import build_parser
from launcher.cli.options import BUILDS
from launcher.errors import UsageError
from launcher.hardware import topology
from launcher.knobs import RENAMED, Check, at_least, knobs_of, migrate
from launcher.plan.kernels import KNOBS as KERNEL_KNOBS
from launcher.request import RunRequest
from launcher.runspec import MAX_GPUS, MAX_NODES, LaunchSpec, RunSettings

from tests.helpers import REPO

KNOBS = knobs_of(RunSettings)
RUNS = ("run", "lab", "scale", "tune")  # the commands whose options make a run
# where a command means something else by a knob's flag, it keeps a field of its own
OWN = {("plan", "gpus"), ("plan", "nodes"), ("scale", "gpus"), ("tune", "steps"), ("tune", "warmup_steps"),
       ("doctor", "gpus"), ("doctor", "nodes"), ("doctor", "precision")}


def test_each_knob_keeps_its_name_from_flag_to_json():
    assert len(KNOBS) >= 25
    spec = LaunchSpec(workload="/w.py", run_id="r", run_dir="/r").to_dict()
    for name, k in KNOBS.items():
        assert k.flag == "--" + name.replace("_", "-"), name
        assert name in spec, name  # launch.json's key is the knob's name
        assert k.help and (k.check is None or isinstance(k.check, Check)), name


def test_the_option_table_takes_each_knob_from_its_declaration():
    by_flag: dict[str, list] = {}
    for o in OPTIONS:
        by_flag.setdefault(o.flag, []).append(o)
    for name, k in KNOBS.items():
        [opt] = by_flag[k.flag]  # one entry per flag
        assert opt.knob == name and opt.help == k.help and opt.check == k.check and opt.choices == k.choices
        assert opt.default == RunSettings.__dataclass_fields__[name].default
    assert not [o.flag for o in OPTIONS if o.knob is None and o.dest in KNOBS]


def test_typed_options_hold_the_knobs_in_settings_not_in_fields_of_their_own():
    for command, cls in BUILDS.items():
        own = {f.name for f in dataclasses.fields(cls)} & set(KNOBS)
        assert {(command, n) for n in own} <= OWN, command
        if command in RUNS or command == "plan":
            assert "settings" in {f.name for f in dataclasses.fields(cls)}, command


def test_the_request_and_the_spec_declare_no_knob_of_their_own():
    for cls in (RunRequest, LaunchSpec):
        assert not set(vars(cls).get("__annotations__", {})) & set(KNOBS), cls
        assert issubclass(cls, RunSettings)


def _knob_calls() -> list[str]:
    flags = []
    for path in (REPO / "launcher").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "knob":
                flags.append(ast.literal_eval(node.args[1]))
    return flags


def test_a_knob_is_declared_once_in_the_source():
    flags = _knob_calls()
    assert sorted(flags) == sorted(k.flag for k in KNOBS.values())
    args = (REPO / "launcher" / "cli" / "args.py").read_text(encoding="utf-8")
    assert not [f for f in flags if f'Option("{f}"' in args]


def test_old_spellings_live_only_in_the_migration():
    # `num_nodes` stays the name of what a topology, a plan and a result describe (the hardware a
    # run had); the knob that asks for nodes is `nodes`
    old = [*(k for k in RENAMED if k != "num_nodes"), "recompute_fraction", "activation_checkpointing"]
    found = []
    for path in (REPO / "launcher").rglob("*.py"):
        if path.name == "knobs.py":
            continue
        text = path.read_text(encoding="utf-8")
        found += [f"{path.name}: {w}" for w in old if re.search(rf"(?<!--)\b{w}\b", text)]  # not torchrun's flags
    assert found == []


def test_an_old_launch_json_reads_in_todays_names():
    old = {"workload": "/w.py", "run_id": "r", "run_dir": "/r", "num_nodes": 1, "nproc_per_node": 2,
           "grad_accum_steps": 4, "calibrate_comm": False, "log_every": 0, "shard_group_size": 0,
           "loader": {"num_workers": 2, "prefetch_factor": 2},
           "strategy": {"kind": "fsdp_full", "precision": "bf16", "activation_checkpointing": True, "tp": 1}}
    spec = LaunchSpec.from_dict(old)
    assert (spec.gpus, spec.grad_accum, spec.calibrate, spec.num_workers) == (2, 4, False, 2)
    assert (spec.strategy, spec.precision, spec.checkpointing) == ("fsdp_full", "bf16", "full")
    assert spec.log_every is None and spec.shard_group_size is None
    assert LaunchSpec.from_dict(spec.to_dict()) == spec == LaunchSpec.from_dict(migrate(old))


@pytest.mark.parametrize("name, value, needle", [
    ("steps", 0, "`steps` must be an integer >= 1, got 0"),
    ("max_grad_norm", float("nan"), "`max_grad_norm` must be a finite number >= 0, got nan"),
    ("num_workers", True, "`num_workers` must be an integer >= 0, got True"),
    ("strategy", "zero3", "unknown `strategy` 'zero3'"),
])
def test_each_check_is_the_declared_one(name, value, needle):
    with pytest.raises(UsageError) as e:
        RunSettings(**{name: value})
    assert needle.replace("`", "") in str(e.value).replace("`", "")


def test_a_decision_left_open_takes_its_fallback_in_the_spec():
    spec = LaunchSpec(workload="/w.py", run_id="r", run_dir="/r", steps=2)
    decided = RunSettings().decided()
    assert {k: getattr(spec, k) for k in decided} == decided
    assert spec.warmup_steps == 1 and spec.compile_mode == "default"


def test_the_planner_reads_its_overrides_by_attribute_only():
    from launcher.plan.types import Overrides

    found = [f"{p.relative_to(REPO)}:{n}" for p in (REPO / "launcher").rglob("*.py")
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if re.search(r"\b(overrides|ov)(\[|\.get\()", line)]
    assert found == []
    # its fields are the plan's decisions among the knobs, by the knobs' names, and what the run
    # does that the plan prices but never chooses: the kernels it calls (launcher.plan.kernels),
    # the compile mode and the dtype its gradients are reduced in
    kernels = set(KERNEL_KNOBS.values())
    assert kernels <= set(KNOBS)
    assert {f.name for f in dataclasses.fields(Overrides)} <= {k for k, d in KNOBS.items() if d.planned} | {
        "compile_mode", "reduce_dtype"} | kernels


def test_every_number_has_an_upper_bound_in_its_one_declaration():
    declared = [(k.flag, k.check) for k in KNOBS.values()] + [(o.flag, o.check) for o in OPTIONS]
    assert not [flag for flag, c in declared if c is not None and c.high is None]
    assert (MAX_GPUS, MAX_NODES) == (topology.MAX_DEVICES_PER_NODE, topology.MAX_NODES)
    # and --help says it, beside the option's own words
    parser = argparse.ArgumentParser()
    add_options(parser, "run")
    help_text = parser.format_help()
    assert "(at most 1,000,000,000)" in help_text and "(at most 1,000,000)" in help_text


def test_a_number_past_its_bound_is_refused_naming_the_bound():
    steps = KNOBS["steps"].check.parser("--steps")
    assert steps("1000000000") == steps("1e9") == 10**9  # a count in scientific notation is a count
    with pytest.raises(UsageError, match=r"^--steps must be at most 1,000,000,000 \(no real run needs "
                                         r"more\), got 99999999999999999999$"):
        steps("99999999999999999999")
    with pytest.raises(UsageError, match=r"^--steps must be an integer >= 1, got '2.5'$"):
        steps("2.5")
    with pytest.raises(UsageError, match=r"^`micro_batch` must be at most 1,000,000 \(no real run needs "
                                         r"more\), got 10000000$"):
        RunSettings(micro_batch=10**7)  # made in code (a launch.json, a plan): the same bound
    assert at_least(1, 10).ok(10) and not at_least(1, 10).ok(11)


@pytest.mark.parametrize("given", ["-1e12", "-0.5", "-.5", "-1E+3", "-2"])
def test_a_negative_number_is_a_value_the_check_refuses(given: str):
    with pytest.raises(UsageError, match=f"^--tokens must be a finite number > 0, got {re.escape(given)}$"):
        build_parser().parse_args(["plan", "w.py", "--tokens", given])

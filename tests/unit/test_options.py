"""The option table: each flag declared once, parsers and dlaunch.yaml keys derived from it, and
the one merge flag > dlaunch.yaml > default."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from launcher.cli.args import OPTIONS, name_flags, options_of, resolve, yaml_keys
from launcher.cli.config import load_config
from launcher.cli.main import build_parser
from launcher.errors import ConfigError, UsageError


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def test_each_flag_is_declared_once():
    counts = Counter(o.flag for o in OPTIONS)
    assert [flag for flag, n in counts.items() if n > 1] == []


def test_each_command_parser_takes_exactly_its_declared_options():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for command, p in sub.choices.items():
        taken = {s for a in p._actions for s in a.option_strings if s not in ("-h", "--help", "--debug")}
        declared = {o.flag for o in options_of(command) if not o.positional}
        declared |= {f"--no-{o.flag[2:]}" for o in options_of(command) if o.kind == "toggle"}
        assert taken == declared, command


def test_every_option_has_help_with_its_default_and_run_shows_examples():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for command, p in sub.choices.items():
        for a in p._actions:
            assert a.help, f"dlaunch {command} {a.option_strings or a.dest}: no help"
    text = sub.choices["run"].format_help()
    said = " ".join(text.split())  # argparse wraps the help: compare it unwrapped
    for flag, default in (("--gpus", "1"), ("--steps", "20"), ("--seed", "0"), ("--num-workers", "0"),
                          ("--max-grad-norm", "0")):
        help_of = re.search(rf" {flag} [A-Z_]+ (.*?)(?= --[a-z]|$)", said.split("options:", 1)[1])
        assert help_of is not None and f"(default: {default})" in help_of[1], flag
    examples = text.split("examples:\n", 1)[1].splitlines()
    runs = [line for line in examples if line.strip().startswith("dlaunch run ")]
    assert len(runs) == 3 and any("--slurm" in line for line in runs)
    assert sub.choices["run"].format_usage() in text


def test_yaml_keys_are_the_options_that_declare_one(tmp_path: Path):
    keys = yaml_keys()
    assert set(keys) == {o.yaml_key for o in OPTIONS if o.yaml is not None}
    assert {"slurm.partition", "slurm.time_min", "slurm.opts", "slurm.topology"} <= set(keys)
    (tmp_path / "dlaunch.yaml").write_text("slurm:\n  parttion: gpu\n")
    with pytest.raises(ConfigError, match="known keys: .*partition"):
        load_config(tmp_path)


def test_flag_beats_yaml_beats_default(tmp_path: Path):
    configured = {"slurm.partition": "from-yaml", "slurm.time_min": 30, "slurm.opts": {"mem": "4G"}}
    values = resolve("run", parse("run", "w.py", "--slurm", "--time-min", "45", "--slurm-opt", "gres=gpu:1"),
                     configured)
    assert values["time_min"] == 45.0 and values["partition"] == "from-yaml"
    assert values["slurm_opt"] == (("gres", "gpu:1"), ("mem", "4G"))  # merged key by key
    assert values["account"] is None and values["steps"] == 20 and values["dry_run"] is False
    assert resolve("run", parse("run", "w.py", "--slurm"), {})["time_min"] == 60.0


def test_slurm_flags_need_slurm_and_defaults_differ_per_command():
    with pytest.raises(UsageError, match="--partition needs --slurm"):
        resolve("run", parse("run", "w.py", "--partition", "gpu"), {})
    # `scale --topology` is a local option, `run --topology` a SLURM one
    assert resolve("scale", parse("scale", "w.py", "--gpus", "1", "--topology", "t"), {})["topology"] == "t"
    assert resolve("plan", parse("plan", "w.py"), {})["gpus"] is None
    assert resolve("run", parse("run", "w.py"), {})["gpus"] == 1


def test_field_names_become_flags_in_error_lines():
    assert name_flags("`warmup_steps` must be below `steps` (5)") == "--warmup-steps must be below --steps (5)"
    assert name_flags("`gpus` and `grad_accum`") == "--gpus and --grad-accum"  # one name per knob
    assert name_flags("`prefetch_factor` stays") == "`prefetch_factor` stays"  # no such flag

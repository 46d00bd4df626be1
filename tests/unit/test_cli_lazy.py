"""The CLI builds its parser without importing a command's module tree (issue 22): `dlaunch
--help` and `dlaunch <command> --help` load only the option table and its light imports; a
command's handler module is imported when that command runs. Checked by import tracing in a
fresh interpreter, not by timing (benchmarks/cli_start.py times it)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

from launcher.cli.main import COMMANDS, build_parser, load_handler
from launcher.cli.option import COMMANDS as OPTION_COMMANDS

from tests.helpers import REPO

# What building the parsers must not load: the packages that do the work (between them yaml,
# psutil, importlib.metadata, the planner, the backends), the request and run-dir protocol, the
# dlaunch.yaml reader, and every command module (launcher.cli.<command>, prepare)
HEAVY_PACKAGES = ("launcher.drivers", "launcher.plan", "launcher.backends", "launcher.results",
                  "launcher.report", "launcher.hardware", "launcher.runtime")
HEAVY_MODULES = ("launcher.request", "launcher.rundir", "launcher.files", "launcher.workload",
                 "launcher.cli.config", "launcher.cli.prepare",
                 "launcher.cli.run", "launcher.cli.lab", "launcher.cli.scale", "launcher.cli.tune",
                 "launcher.cli.plan", "launcher.cli.inspect", "launcher.cli.report",
                 "launcher.cli.runs", "launcher.cli.doctor")
HEAVY_THIRD_PARTY = ("torch", "yaml", "psutil", "numpy", "submitit", "matplotlib")

# Builds the parser, then asks `dlaunch --help`, `run --help` and `tune --help` (whose text
# shows the tune's trial length) through main(), which exit from argparse, printing the
# modules loaded after each step as one JSON object.
TRACE = """
import contextlib, io, json, sys
from launcher.cli.main import build_parser, main

def loaded():
    return sorted(m for m in sys.modules if m == "launcher" or m.startswith("launcher.")
                  or m.split(".")[0] in {heavy!r})

steps = {{}}
build_parser()
steps["build_parser"] = loaded()
for argv in (["--help"], ["run", "--help"], ["tune", "--help"]):
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            main(argv)
        except SystemExit as e:
            assert e.code == 0, (argv, e.code)
    steps[" ".join(argv)] = loaded()
print(json.dumps(steps))
"""


def _is_heavy(module: str) -> bool:
    return (module in HEAVY_MODULES or module.split(".")[0] in HEAVY_THIRD_PARTY
            or any(module == p or module.startswith(p + ".") for p in HEAVY_PACKAGES))


def test_building_the_parser_and_help_load_no_command_module():
    done = subprocess.run([sys.executable, "-c", TRACE.format(heavy=HEAVY_THIRD_PARTY)], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    steps = json.loads(done.stdout)
    assert list(steps) == ["build_parser", "--help", "run --help", "tune --help"]
    for step, modules in steps.items():
        assert [m for m in modules if _is_heavy(m)] == [], f"after {step}"


def test_every_command_names_an_importable_handler():
    assert sorted(c.name for c in COMMANDS) == sorted(OPTION_COMMANDS)
    for command in COMMANDS:
        module, _, attr = command.handler.partition(":")
        assert module.startswith("launcher.cli.") and attr, command.handler
        assert callable(getattr(importlib.import_module(module), attr)), command.handler


def test_the_parsed_namespace_names_the_handler_and_dispatch_imports_it():
    args = build_parser().parse_args(["status", "123"])
    assert args.handler == "launcher.cli.runs:cmd_status"  # a name: imported only to run it
    from launcher.cli.runs import cmd_status

    assert load_handler(args.handler) is cmd_status


def test_version_prints_the_package_version():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "launcher.cli.main", "--version"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("dlaunch ") and not done.stderr


def test_main_run_again_in_one_process_filters_others_logs_once_and_not_under_debug(capsys, monkeypatch):
    import logging

    monkeypatch.delenv("DLAUNCH_DEBUG", raising=False)  # restored after: --debug sets it

    from launcher.cli.main import main

    handler_filters = lambda: [f for h in logging.root.handlers for f in h.filters]  # noqa: E731
    for argv in (["status", "--help"], ["status", "--help"]):
        try:
            main(argv)
        except SystemExit:
            pass
    assert len(handler_filters()) == 1  # once, however many runs
    try:
        main(["--debug", "status", "--help"])
    except SystemExit:
        pass
    assert handler_filters() == []  # --debug shows every library's records
    capsys.readouterr()

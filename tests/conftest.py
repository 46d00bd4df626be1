"""Shared fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import Done, run_dlaunch

# the suite runs two workers on two cores, so the host is never quiet: cache the CPU probes anyway
# (plan.host_quiet), or every plan would measure again; test_host_quiet.py checks the refusal
os.environ.setdefault("DLAUNCH_PROBE_IGNORE_LOAD", "1")


@pytest.fixture
def dlaunch(tmp_path: Path):
    """`dlaunch(*args)` with TMPDIR inside the test's own directory (torchrun leaves files)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()

    def call(*args: str, **kw) -> Done:
        env = {"TMPDIR": str(tmp), **kw.pop("env", {})}
        return run_dlaunch(*args, env=env, **kw)

    return call

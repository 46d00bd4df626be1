"""Shared fixtures."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from tests.helpers import Done, run_dlaunch

# the suite runs two workers on two cores, so the host is never quiet: cache the CPU probes anyway
# (plan.host_quiet), or every plan would measure again; test_host_quiet.py checks the refusal.
# Into a cache of the suite's own: probes taken beside its workers are slower than this host is,
# and the user's cache (~/.cache/dlaunch) would hand them to every later plan
os.environ.setdefault("DLAUNCH_PROBE_IGNORE_LOAD", "1")
os.environ.setdefault("DLAUNCH_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"dlaunch-test-cache-{os.getuid()}"))


@pytest.fixture
def dlaunch(tmp_path: Path):
    """`dlaunch(*args)` with TMPDIR inside the test's own directory (torchrun leaves files)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()

    def call(*args: str, **kw) -> Done:
        env = {"TMPDIR": str(tmp), **kw.pop("env", {})}
        return run_dlaunch(*args, env=env, **kw)

    return call

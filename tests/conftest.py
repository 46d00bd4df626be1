"""Shared fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import Done, run_dlaunch


@pytest.fixture
def dlaunch(tmp_path: Path):
    """`dlaunch(*args)` with TMPDIR inside the test's own directory (torchrun leaves files)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()

    def call(*args: str, **kw) -> Done:
        env = {"TMPDIR": str(tmp), **kw.pop("env", {})}
        return run_dlaunch(*args, env=env, **kw)

    return call

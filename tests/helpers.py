"""Helpers shared by the tests: run the real `dlaunch` CLI in a subprocess, as a user does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORKLOADS = REPO / "workloads"
DATA = Path(__file__).resolve().parent / "data"


@dataclass
class Done:
    """A finished dlaunch invocation."""

    code: int
    out: str
    err: str

    def json(self) -> dict:
        return json.loads(self.out)


def run_dlaunch(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
                timeout: float = 300) -> Done:
    """Run `python -m launcher.cli.main ARGS` and capture everything."""
    full_env = {**os.environ, **(env or {})}
    full_env.pop("DLAUNCH_DEBUG", None)
    proc = subprocess.run([sys.executable, "-m", "launcher.cli.main", *args], cwd=cwd or REPO,
                          env=full_env, capture_output=True, text=True, timeout=timeout)
    return Done(proc.returncode, proc.stdout, proc.stderr)


def assert_one_line_error(done: Done, *needles: str) -> None:
    """Bad input: exit 2, one line on stderr, no traceback, every needle in the line."""
    assert done.code == 2, (done.code, done.out, done.err)
    lines = [line for line in done.err.splitlines() if line.strip()]
    assert len(lines) == 1, done.err
    assert "Traceback" not in done.err
    for n in needles:
        assert n in lines[0], (n, lines[0])

"""scripts/gpu-acceptance.sh: the GPU acceptance run parses, and its CPU dry mode runs every
step (inspect, doctor, plan, the six runs) and writes its table with every check passed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

SCRIPT = REPO / "scripts" / "gpu-acceptance.sh"
MAX_FILES = 8  # what the device machine hands back


def test_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


@pytest.mark.distributed
def test_cpu_dry_mode_passes_every_check(tmp_path: Path):
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "PYTHON": sys.executable, "ACCEPT_OUT": str(out), "ACCEPT_WORK": str(work)}
    proc = subprocess.run(["bash", str(SCRIPT), "--cpu"], env=env, capture_output=True, text=True,
                          timeout=600)
    table = (out / "table.md").read_text()
    assert proc.returncode == 0, table + proc.stderr[-3000:] + (out / "log.txt").read_text()[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["doctor.json", "inspect.json", "log.txt", "plan.json", "results.json",
                     "runs.tar.gz", "table.md"]
    assert len(files) <= MAX_FILES
    assert "| fp32 | 0 | ok |" in table and "| fsdp-1gpu | 0 | ok |" in table, table
    assert " 0 failed" in table.splitlines()[-1], table

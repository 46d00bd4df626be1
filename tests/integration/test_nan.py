"""A NaN loss: a warning in the run summary (or, with --stop-on-nan, a failed run that says why),
and every JSON file of the run strict JSON (null for NaN), with real torchrun on 2 CPU ranks.

The loss is checked where the harness already has it on the host (the end of a logging window,
after the loss all-reduce), so no step pays for an extra device sync.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.rundir import RunPaths

from tests.helpers import DATA, REPO, assert_processes_gone, rank_pids, rank_steps, strict_json

STEPS, NAN_STEP = 8, 3
PLAN = ("--gpus", "2", "--steps", str(STEPS), "--strategy", "ddp", "--precision", "fp32",
        "--micro-batch", "4", "--no-calibrate", "--log-every", "2")
BOUND_S = 180


def _run(tmp_path: Path, *flags: str) -> tuple[Path, int, str]:
    run_dir = tmp_path / "run"
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "OMP_NUM_THREADS": "1"}
    env.pop("DLAUNCH_DEBUG", None)
    proc = subprocess.run(
        [sys.executable, "-m", "launcher.cli.main", "run", str(DATA / "nan_loss.py"), *PLAN, *flags,
         "--run-dir", str(run_dir), "--", "--nan-step", str(NAN_STEP)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=BOUND_S)
    assert_processes_gone(rank_pids(run_dir))
    return run_dir, proc.returncode, proc.stdout + proc.stderr


def _every_json_is_strict(run_dir: Path) -> dict:
    files = [p for p in run_dir.rglob("*") if p.suffix in (".json", ".jsonl") and p.is_file()]
    assert files
    for path in files:
        text = path.read_text()
        for doc in (text.splitlines() if path.suffix == ".jsonl" else [text]):
            strict_json(doc)
    return strict_json(RunPaths(root=run_dir).result.read_text())


@pytest.mark.distributed
def test_nan_loss_warns_and_writes_strict_json(tmp_path: Path):
    run_dir, code, text = _run(tmp_path)
    assert code == 0, text
    assert f"WARNING: the loss was NaN or infinite at step {NAN_STEP} (rank(s) 0, 1)" in text, text
    result = _every_json_is_strict(run_dir)
    assert result["status"] == "ok"
    assert f"OK, LOSS NAN FROM STEP {NAN_STEP} (exit 0" in text, text  # the summary's status
    assert any(w.startswith(f"the loss was NaN or infinite at step {NAN_STEP}") for w in result["warnings"])
    assert text.count("the loss was NaN or infinite") == 1, text
    assert [r["nonfinite_loss_step"] for r in result["ranks"]] == [NAN_STEP, NAN_STEP]
    losses = [loss for _, loss in rank_steps(run_dir)]
    assert len(losses) == STEPS and None not in losses[:NAN_STEP - 1]
    assert losses[NAN_STEP - 1:] == [None] * (STEPS - NAN_STEP + 1)  # NaN written as null
    summary = strict_json(RunPaths(root=run_dir).summary(0).read_text())
    assert summary["nonfinite_loss"] == {"step": NAN_STEP, "loss": "nan"}


@pytest.mark.distributed
def test_stop_on_nan_ends_the_run_at_that_window(tmp_path: Path):
    run_dir, code, text = _run(tmp_path, "--stop-on-nan")
    assert code == 1, text
    result = _every_json_is_strict(run_dir)
    assert result["status"] == "failed"
    why = f"NonFiniteLoss: the loss is nan at step {NAN_STEP}; --stop-on-nan ended the run"
    assert len(result["failures"]) == 2 and all(why in f for f in result["failures"])
    assert why in text and "Traceback" not in text
    # the window that held step 3 was the last: no step after it ran to the end
    assert max(s for s, _ in rank_steps(run_dir)) < STEPS

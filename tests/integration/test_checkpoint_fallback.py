"""A damaged newest checkpoint: the relaunch falls back to the one before, or fails in one line.

Real torchrun, 2 CPU ranks, tests/data/corrupt_checkpoint.py: rank 1 raises in step 10 of
attempt 0 (checkpoints at steps 4 and 8), and the relaunch (`--max-restarts 1`) damages the
checkpoints before it resumes. A checkpoint is trusted only when every file its completion
marker lists has the listed size and CRC-32 (launcher.runtime.checkpoint).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.rundir import RunPaths
from launcher.runtime import checkpoint

from tests.helpers import (
    DATA,
    REPO,
    assert_processes_gone,
    rank_pids,
    rank_records,
    rank_steps,
    run_result,
)

STEPS, EVERY, FAULT_STEP = 12, 4, 10
WORKLOAD = str(DATA / "corrupt_checkpoint.py")
PLAN = ("--gpus", "2", "--steps", str(STEPS), "--strategy", "ddp", "--precision", "fp32",
        "--micro-batch", "4", "--no-calibrate", "--checkpoint-every", str(EVERY),
        "--max-restarts", "1")
BOUND_S = 240  # two attempts of a tiny model; a run that never ends fails here


def _run(tmp_path: Path, corrupt: str) -> tuple[Path, int, str]:
    run_dir = tmp_path / f"run-{corrupt}"
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "OMP_NUM_THREADS": "1"}
    env.pop("DLAUNCH_DEBUG", None)
    proc = subprocess.run(
        [sys.executable, "-m", "launcher.cli.main", "run", WORKLOAD, *PLAN, "--run-dir",
         str(run_dir), "--", "--fault", "raise", "--fault-step", str(FAULT_STEP),
         "--fault-attempt", "0", "--corrupt", corrupt],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=BOUND_S)
    assert_processes_gone(rank_pids(run_dir))
    return run_dir, proc.returncode, proc.stdout + proc.stderr


@pytest.mark.distributed
@pytest.mark.parametrize(("corrupt", "why"), [("shards", "bytes"), ("overwrite", "fails its checksum")])
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path: Path, corrupt: str, why: str):
    # cut to half its size, or 64 bytes overwritten in place (the size unchanged)
    run_dir, code, text = _run(tmp_path, corrupt)
    assert code == 0, text
    assert "step-000008 passed over" in text and why in text, text
    first = RunPaths(root=run_dir).attempt(0).root
    for rank in (0, 1):
        resume = next(r for r in rank_records(run_dir, rank) if r["kind"] == "resume")
        assert resume["step"] == EVERY, resume
        assert resume["passed_over"] and resume["passed_over"][0].startswith("step-000008: ")
        resumed = rank_steps(run_dir, rank)
        assert [s for s, _ in resumed] == list(range(EVERY + 1, STEPS + 1))
        # from step 4's state steps 5-8 give attempt 0's losses (its step 9 is a rank's own
        # loss, recorded as the window broke off)
        assert resumed[:EVERY] == rank_steps(first, rank)[EVERY:2 * EVERY]
    result = run_result(run_dir)
    assert result["status"] == "ok"
    assert [r["resumed_from_step"] for r in result["ranks"]] == [EVERY, EVERY]


@pytest.mark.distributed
def test_no_usable_checkpoint_fails_with_one_line_naming_each(tmp_path: Path):
    run_dir, code, text = _run(tmp_path, "rng")
    assert code == 1, text
    lines = [line for line in text.splitlines() if "no usable checkpoint" in line]
    assert lines, text
    assert all("step-000008: 'rng-1.pt' is" in line and "step-000004: 'rng-1.pt' is" in line
               for line in lines), lines
    assert "Traceback" not in text and "OSError" not in text
    summary = run_result(run_dir)
    assert summary["status"] == "failed"
    assert any("CheckpointUnusable" in f for f in summary["failures"]), summary["failures"]


def test_problem_names_the_cut_off_file_and_a_missing_marker(tmp_path: Path):
    """In one process: the size check itself, without torchrun."""
    import torch

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    for step in (1, 2):
        checkpoint.save(step, model, opt, tmp_path)
    assert checkpoint.problem(checkpoint.step_dir(tmp_path, 2)) is None
    rng = checkpoint.step_dir(tmp_path, 2) / "rng-0.pt"
    rng.write_bytes(rng.read_bytes()[:10])
    why = checkpoint.problem(checkpoint.step_dir(tmp_path, 2))
    assert why is not None and why.startswith("'rng-0.pt' is 10 bytes")
    assert checkpoint.pick(tmp_path) == (1, [f"step-000002: {why}"])
    # the same size, other bytes: the checksum tells
    shard = next(checkpoint.step_dir(tmp_path, 1).glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    why1 = checkpoint.problem(checkpoint.step_dir(tmp_path, 1))
    assert why1 is not None and "fails its checksum" in why1, why1
    assert checkpoint.pick(tmp_path) == (None, [f"step-000002: {why}", f"step-000001: {why1}"])
    (checkpoint.step_dir(tmp_path, 1) / checkpoint.MARKER).unlink()
    assert checkpoint.latest(tmp_path) is None
    with pytest.raises(checkpoint.CheckpointUnusable, match="step-000002: .*step-000001: no completion"):
        checkpoint.load(model, opt, tmp_path)


def test_a_marker_from_before_checksums_is_checked_by_size(tmp_path: Path):
    import json

    import torch

    model = torch.nn.Linear(4, 2)
    checkpoint.save(1, model, torch.optim.AdamW(model.parameters()), tmp_path)
    marker = checkpoint.step_dir(tmp_path, 1) / checkpoint.MARKER
    saved = json.loads(marker.read_text())
    assert all(len(v) == 2 for v in saved["files"].values())  # [size, crc32]
    marker.write_text(json.dumps({**saved, "files": {k: v[0] for k, v in saved["files"].items()}}))
    assert checkpoint.problem(marker.parent) is None
    rng = marker.parent / "rng-0.pt"
    rng.write_bytes(rng.read_bytes()[:10])
    assert "is 10 bytes" in (checkpoint.problem(marker.parent) or "")

"""Measurement truth on real 2-rank runs (torchrun, gloo): a known delay on every gradient
all-reduce shows up as exposed communication, and a rank slowed on purpose is named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import (
    DATA,
    WORKLOADS,
    Done,
    rank_losses,
    rank_records,
    run_dlaunch,
    run_result,
)

pytestmark = [pytest.mark.distributed, pytest.mark.alone]

DELAY_MS = 150
# small enough that DDP puts every gradient in ONE bucket: one all-reduce, one delay per step
ONE_BUCKET = ["--features", "64", "--hidden", "64", "--depth", "2"]


def run(tmp: Path, name: str, *args: str, env: dict[str, str] | None = None) -> Done:
    (tmp / "tmp").mkdir(exist_ok=True)
    return run_dlaunch("run", "--run-dir", str(tmp / name), *args,
                       env={"TMPDIR": str(tmp / "tmp"), **(env or {})})


# fixed strategy and precision: the calibrated and the plain run must train the same way
ARGS = (str(WORKLOADS / "mlp.py"), "--gpus", "2", "--steps", "8", "--strategy", "ddp",
        "--precision", "fp32", "--json")


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory) -> tuple[Path, Done]:
    tmp = tmp_path_factory.mktemp("calibrated")
    done = run(tmp, "base", *ARGS, "--", *ONE_BUCKET)
    assert done.code == 0, done.err[-3000:]
    return tmp / "base", done


def test_injected_allreduce_delay_is_measured_as_exposed_comm(calibrated, tmp_path):
    _, base = calibrated
    slow = run(tmp_path, "delayed", *ARGS, "--", *ONE_BUCKET,
               env={"DLAUNCH_INJECT_COMM_DELAY_MS": str(DELAY_MS)})
    assert slow.code == 0, slow.err[-3000:]
    rise = slow.json()["exposed_comm_s"] - base.json()["exposed_comm_s"]
    assert rise == pytest.approx(DELAY_MS / 1000, rel=0.15), (base.json()["exposed_comm_s"],
                                                              slow.json()["exposed_comm_s"])


def test_calibration_runs_after_training_and_leaves_the_losses_alone(calibrated, tmp_path):
    run_dir, _ = calibrated
    plain = run(tmp_path, "plain", *ARGS, "--no-calibrate", "--", *ONE_BUCKET)
    assert plain.code == 0, plain.err[-3000:]
    for rank in range(2):
        recs = rank_records(run_dir, rank)
        kinds = [r["kind"] for r in recs]
        # measured after the last step: the first step never waits for it
        assert kinds.index("comm") > max(i for i, k in enumerate(kinds) if k == "step"), kinds
        comm = recs[kinds.index("comm")]
        assert comm["sync_steps"] == 5 and comm["nosync_passes"] >= 1, comm
        assert comm["busbw_gb_s"] > 0, comm
        assert "comm" not in [r["kind"] for r in rank_records(tmp_path / "plain", rank)]
    # no extra pass before any optimizer step: DDP trains bit for bit as without calibration
    losses = rank_losses(run_dir)
    assert losses == rank_losses(tmp_path / "plain") and len(losses) == 8, losses


@pytest.fixture(scope="module")
def slowed_run(tmp_path_factory) -> tuple[Path, Done]:
    tmp = tmp_path_factory.mktemp("straggler")
    done = run(tmp, "run", str(DATA / "slow_rank.py"), "--gpus", "2", "--steps", "8")
    assert done.code == 0, done.err[-3000:]
    return tmp / "run", done


def test_slowed_rank_is_the_straggler_in_the_report(slowed_run, tmp_path):
    run_dir, _ = slowed_run
    done = run_dlaunch("report", str(run_dir), "--format", "html,json", "--no-predict",
                       env={"TMPDIR": str(tmp_path)}, timeout=120)
    assert done.code == 0, done.err
    assert "STRAGGLER in run: rank 1 on" in done.out, done.out
    numbers = json.loads((run_dir / "report" / "report.json").read_text())
    assert [s["rank"] for s in numbers["points"][0]["stragglers"]] == [1]
    assert "STRAGGLER in run: rank 1" in (run_dir / "report" / "report.html").read_text()


def test_slowed_rank_is_the_straggler_in_result_and_summary(slowed_run):
    run_dir, done = slowed_run
    assert run_result(run_dir)["stragglers"] == [1]
    assert any(line.startswith("STRAGGLER: rank 1 ") for line in done.out.splitlines()), done.out

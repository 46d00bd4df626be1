"""Measurement truth on real 2-rank runs (torchrun, gloo): a known delay on every gradient
all-reduce shows up as exposed communication, and a rank slowed on purpose is named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import DATA, WORKLOADS, Done, run_dlaunch, run_result

pytestmark = pytest.mark.distributed

DELAY_MS = 150
# small enough that DDP puts every gradient in ONE bucket: one all-reduce, one delay per step
ONE_BUCKET = ["--features", "64", "--hidden", "64", "--depth", "2"]


def run(tmp: Path, name: str, *args: str, env: dict[str, str] | None = None) -> Done:
    (tmp / "tmp").mkdir(exist_ok=True)
    return run_dlaunch("run", "--run-dir", str(tmp / name), *args,
                       env={"TMPDIR": str(tmp / "tmp"), **(env or {})})


def test_injected_allreduce_delay_is_measured_as_exposed_comm(tmp_path):
    args = (str(WORKLOADS / "mlp.py"), "--gpus", "2", "--steps", "8", "--json", "--", *ONE_BUCKET)
    base = run(tmp_path, "base", *args)
    assert base.code == 0, base.err[-3000:]
    slow = run(tmp_path, "delayed", *args, env={"DLAUNCH_INJECT_COMM_DELAY_MS": str(DELAY_MS)})
    assert slow.code == 0, slow.err[-3000:]
    rise = slow.json()["exposed_comm_s"] - base.json()["exposed_comm_s"]
    assert rise == pytest.approx(DELAY_MS / 1000, rel=0.15), (base.json()["exposed_comm_s"],
                                                              slow.json()["exposed_comm_s"])


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

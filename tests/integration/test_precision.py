"""Precision handling inside real ranks: fp16 GradScaler skips are counted and warned about."""

import pytest

from tests.helpers import DATA, run_result

pytestmark = pytest.mark.distributed


def test_fp16_overflow_counts_skipped_steps_and_warns(dlaunch, tmp_path):
    done = dlaunch("run", str(DATA / "fp16_overflow.py"), "--steps", "10", "--precision", "fp16",
                   "--max-grad-norm", "1.0", "--run-dir", str(tmp_path / "run"), "--", "--overflow-every", "2")
    assert done.code == 0, done.err
    assert "WARNING: rank 0 skipped 5 of 10 optimizer steps" in done.out
    result = run_result(tmp_path / "run")
    assert result["ranks"][0]["skipped_steps"] == 5


def test_fp16_without_overflow_does_not_warn(dlaunch, tmp_path):
    done = dlaunch("run", str(DATA / "fp16_overflow.py"), "--steps", "6", "--precision", "fp16",
                   "--run-dir", str(tmp_path / "run"), "--", "--overflow-every", "1000")
    assert done.code == 0, done.err
    # other warnings (a busy host, a missed prediction) depend on the machine, not on fp16
    assert "skipped" not in done.out, done.out
    assert run_result(tmp_path / "run")["ranks"][0]["skipped_steps"] == 0

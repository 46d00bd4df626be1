"""`--reduce-dtype bf16` on CPU ranks: DDP's buckets through dlaunch's bf16 hook and FSDP2's
reduce-scatter in bf16 (gloo reduces bf16), against the same run reducing in fp32.

The sums round to bf16, so the losses leave fp32's after the first update and stay within bf16's
rounding of them; the run records what it reduced in.
"""

import json
from pathlib import Path

import pytest

from tests.helpers import REPO, rank_losses, run_dlaunch

pytestmark = pytest.mark.distributed

GPT = str(REPO / "workloads" / "gpt.py")
STEPS = 12


def train(run_dir: Path, strategy: str, reduce_dtype: str) -> list[float]:
    done = run_dlaunch("run", GPT, "--gpus", "2", "--strategy", strategy, "--precision", "bf16",
                       "--reduce-dtype", reduce_dtype, "--micro-batch", "4", "--steps", str(STEPS),
                       "--warmup-steps", "0", "--no-calibrate", "--run-dir", str(run_dir), "--",
                       "--seq-len", "32", env={"TMPDIR": str(run_dir.parent)})
    assert done.code == 0, done.out + done.err
    spec = json.loads((run_dir / "launch.json").read_text())
    result = json.loads((run_dir / "result.json").read_text())
    assert spec["reduce_dtype"] == result["reduce_dtype"] == reduce_dtype
    assert ("+ bf16 gradient reduce" in done.out) == (reduce_dtype == "bf16")
    return rank_losses(run_dir)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp_full"])
def test_a_bf16_reduce_trains_as_fp32_does_within_its_rounding(tmp_path, strategy):
    fp32 = train(tmp_path / "fp32", strategy, "fp32")
    bf16 = train(tmp_path / "bf16", strategy, "bf16")
    assert len(bf16) == len(fp32) == STEPS
    assert bf16[0] == fp32[0]  # the first forward precedes any reduction
    assert bf16 != fp32  # the gradients did cross in bf16
    assert abs(bf16[-1] - fp32[-1]) / fp32[-1] < 0.02, (bf16, fp32)
    assert bf16[-1] < bf16[0]  # it trains


def test_a_bf16_reduce_needs_bf16_compute(tmp_path):
    done = run_dlaunch("run", GPT, "--gpus", "2", "--precision", "fp32", "--reduce-dtype", "bf16",
                       "--run-dir", str(tmp_path / "run"))
    assert done.code == 2
    assert done.err.strip().count("\n") == 0 and "--reduce-dtype" in done.err and "--precision bf16" in done.err
    assert not (tmp_path / "run").exists()

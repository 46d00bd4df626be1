"""Float8 training on CPU ranks: torchao's Float8Linear in emulation, under DDP and FSDP.

Emulation runs float8's casts, scales and amax reductions with the GEMM in high precision, so
the path a GPU run takes (conversion, its skips, FSDP around converted layers) is exercised here;
the losses follow bf16's within float8's rounding.
"""

import json
from pathlib import Path

import pytest

from tests.helpers import REPO, rank_losses, rank_records, run_dlaunch

pytestmark = pytest.mark.distributed

GPT = str(REPO / "workloads" / "gpt.py")
STEPS = 20


def train(run_dir: Path, strategy: str, *extra: str) -> list[float]:
    done = run_dlaunch("run", GPT, "--gpus", "2", "--strategy", strategy, "--precision", "bf16",
                       "--micro-batch", "4", "--steps", str(STEPS), "--warmup-steps", "0",
                       "--no-calibrate", "--run-dir", str(run_dir), *extra, "--", "--seq-len", "32",
                       env={"TMPDIR": str(run_dir.parent)})
    assert done.code == 0, done.out + done.err
    return rank_losses(run_dir)


@pytest.fixture(scope="module")
def bf16(tmp_path_factory) -> list[float]:
    return train(tmp_path_factory.mktemp("bf16") / "run", "ddp")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp_full"])
def test_float8_trains_within_2_percent_of_bf16_and_lists_its_layers(bf16, tmp_path, strategy):
    got = train(tmp_path / "run", strategy, "--float8", "tensorwise")
    assert len(got) == len(bf16) == STEPS
    assert all(x == x and abs(x) != float("inf") for x in got)
    assert abs(got[-1] - bf16[-1]) / bf16[-1] < 0.02, (got, bf16)
    assert got[-1] < got[0]  # it trains
    wrap = next(r for r in rank_records(tmp_path / "run") if r["kind"] == "wrap")
    f8 = wrap["float8"]
    assert f8["recipe"] == "tensorwise" and f8["emulated"] is True
    # gpt tiny: 4 blocks x (wq, wk, wv, wo, w1, w2, w3) converted, the output head kept in bf16
    assert len(f8["converted"]) == 28 and all(n.startswith("layers.") for n in f8["converted"])
    assert [s["layer"] for s in f8["skipped"]] == ["head"]
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["float8"] == "tensorwise" and result["precision"] == "bf16"

"""Every strategy trains the same model as one process on the global batch (fp32, gloo, CPU)."""

from pathlib import Path

import pytest

from launcher.files import read_jsonl
from tests.helpers import REPO, run_dlaunch

pytestmark = pytest.mark.distributed

GPT = str(REPO / "workloads" / "gpt.py")
STEPS = 10
GLOBAL_BATCH = 8
WORKLOAD_ARGS = ["--", "--seq-len", "32"]


def losses(run_dir: Path) -> list[float]:
    records, _ = read_jsonl(run_dir / "rank-0.jsonl")
    return [r["loss"] for r in records if r["kind"] == "step"]


def train(run_dir: Path, *, gpus: int, strategy: str, accum: int) -> list[float]:
    micro = GLOBAL_BATCH // (gpus * accum)
    done = run_dlaunch("run", GPT, "--gpus", str(gpus), "--strategy", strategy, "--grad-accum", str(accum),
                       "--micro-batch", str(micro), "--steps", str(STEPS), "--warmup-steps", "0",
                       "--precision", "fp32", "--no-calibrate", "--run-dir", str(run_dir), *WORKLOAD_ARGS,
                       env={"TMPDIR": str(run_dir.parent)})
    assert done.code == 0, done.out + done.err
    return losses(run_dir)


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> list[float]:
    return train(tmp_path_factory.mktemp("single") / "run", gpus=1, strategy="ddp", accum=1)


# DDP without accumulation is checked at 1e-5 in tests/test_run_local.py
CASES = [("ddp", 4), ("fsdp_full", 1), ("fsdp_full", 4), ("fsdp_grad_op", 1), ("fsdp_grad_op", 4)]


@pytest.mark.parametrize("strategy, accum", CASES)
def test_strategy_matches_one_process(single, tmp_path, strategy, accum):
    got = train(tmp_path / "run", gpus=2, strategy=strategy, accum=accum)
    worst = max(abs(a - b) / abs(a) for a, b in zip(single, got))
    assert len(got) == STEPS and worst < 1e-4, (worst, single, got)

"""Training from a token file on disk: scripts/make_tokens.py writes nanoGPT's uint16 format,
workloads/tokens.py memory-maps it (gpt.py's model, imported as a neighbour), and the
data-loading verdict follows the reader: a slow read (`--read-delay-ms`) with no DataLoader
workers makes the run data-loading bound; two workers hide the same read behind the compute.

Sizes: the reader's delay is set from this machine's speed, timed just before the runs: a
batch of 8 samples takes as long to read as one training step takes to compute. Without
workers the loop then waits about half of every step (the verdict needs > 20%, which holds
while the compute stays within 4x of the timing); two workers deliver a batch every half step.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from launcher.workload import load_workload

from tests.helpers import REPO, WORKLOADS, assert_one_line_error, log_tails, rank_records, run_result

pytestmark = pytest.mark.alone  # its reader delay is timed against this host's step just before the runs

TOKENS = str(WORKLOADS / "tokens.py")
MODEL = ("--dim", "128", "--layers", "2", "--ffn", "384", "--seq-len", "128")
MICRO_BATCH = 8


def make_tokens(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(REPO / "scripts" / "make_tokens.py"), *args,
                           "-o", str(out)], capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tokens") / "train.bin"
    done = make_tokens(out, str(REPO / "README.md"), "--repeat", "4")
    assert done.returncode == 0, done.stderr
    return out


def test_make_tokens_writes_byte_level_uint16(token_file):
    text = (REPO / "README.md").read_bytes()
    tokens = np.fromfile(token_file, dtype=np.uint16)
    assert tokens.size == 4 * len(text)
    assert bytes(tokens[:len(text)].astype(np.uint8)) == text


def test_make_tokens_refuses_an_empty_input(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    done = make_tokens(tmp_path / "out.bin", str(empty))
    assert done.returncode == 2 and "empty" in done.stderr and not (tmp_path / "out.bin").exists()


def test_samples_are_deterministic_windows_of_the_training_split(token_file):
    w = load_workload(TOKENS, ["--data", str(token_file), *MODEL])
    data = w.make_dataset(16)
    tokens = np.fromfile(token_file, dtype=np.uint16)
    train_end = int(tokens.size * 0.9)
    for i in (0, 7, 15):
        sample = data[i]
        assert sample.shape == (129,) and str(sample.dtype) == "torch.int64"
        assert (sample == w.make_dataset(16)[i]).all()  # item i is item i in every process
        starts = [s for s in range(train_end - 128) if (tokens[s:s + 129] == sample.numpy()).all()]
        assert starts, f"sample {i} is not a window of the training split"


def test_a_missing_token_file_is_one_line(dlaunch, tmp_path):
    done = dlaunch("plan", TOKENS, "--gpus", "1", "--", "--data", str(tmp_path / "none.bin"))
    assert_one_line_error(done, "token file", "not found", "scripts/make_tokens.py")


@pytest.fixture(scope="module")
def read_delay_ms(token_file) -> float:
    """Per-sample read delay that makes reading a batch take one training step's compute,
    timed here (one thread, as the rank runs) on the same model, batch and optimizer."""
    import torch

    w = load_workload(TOKENS, ["--data", str(token_file), *MODEL])
    model, data = w.build_model(), w.make_dataset(MICRO_BATCH)
    optimizer = w.make_optimizer(model)
    batch = torch.stack([data[i] for i in range(MICRO_BATCH)])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = []
        for _ in range(4):
            t0 = time.perf_counter()
            w.loss_fn(model, batch).backward()
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return max(1.0, 1000 * statistics.median(times[1:]) / MICRO_BATCH)


def run_tokens(dlaunch, run_dir: Path, token_file: Path, delay_ms: float, workers: int,
               *extra: str) -> dict:
    done = dlaunch("run", TOKENS, "--gpus", "1", "--strategy", "ddp", "--precision", "fp32",
                   "--micro-batch", str(MICRO_BATCH), "--steps", "10", "--warmup-steps", "3",
                   "--num-workers", str(workers), "--run-dir", str(run_dir), *extra, "--",
                   "--data", str(token_file), "--read-delay-ms", f"{delay_ms:.1f}", *MODEL,
                   env={"OMP_NUM_THREADS": "1"})
    assert done.code == 0, done.out + done.err + log_tails(run_dir)
    return run_result(run_dir)


@pytest.mark.distributed
def test_a_slow_reader_without_workers_is_data_loading_bound(dlaunch, tmp_path, token_file,
                                                             read_delay_ms):
    result = run_tokens(dlaunch, tmp_path / "run", token_file, read_delay_ms, 0)
    assert result["verdict"]["name"] == "data-loading bound", result["verdict"]
    assert result["verdict"]["shares"]["data_wait"] > 0.2


@pytest.mark.distributed
def test_two_workers_hide_the_slow_reader_and_evaluate_runs(dlaunch, tmp_path, token_file,
                                                            read_delay_ms):
    run_dir = tmp_path / "run"
    result = run_tokens(dlaunch, run_dir, token_file, read_delay_ms, 2, "--eval-every", "5")
    assert result["verdict"]["name"] != "data-loading bound", result["verdict"]
    assert result["verdict"]["shares"]["data_wait"] < 0.2
    evaluated = [r for r in rank_records(run_dir) if r["kind"] == "step" and "eval" in r]
    assert [r["step"] for r in evaluated] == [5, 10]
    assert all(0 < r["eval"]["val_loss"] < 10 for r in evaluated)

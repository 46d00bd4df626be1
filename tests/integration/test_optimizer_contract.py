"""The workload's own optimizer, schedule and evaluation under every way the harness trains, with
real torchrun (gloo, CPU): tests/data/sgd_cosine.py (SGD with momentum and weight-decay groups,
a warm-up + cosine LambdaLR, `evaluate` reporting the learning rate) under DDP with accumulation,
FSDP full, hybrid (2 replicas x 1 shard), compile, and a resume after a killed rank. All train
the same global batch of 8 on the same data, so their fp32 losses agree; the resumed run's
losses and learning rates equal the uninterrupted run's (the scheduler state is checkpointed).

Also a nanoGPT-style workload (`from model import GPT` of a neighbour file) that runs unchanged,
planned in the launcher and with a DataLoader worker importing another neighbour.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from launcher.rundir import RunPaths

from tests.helpers import DATA, log_tails, rank_records, rank_steps, run_dlaunch, run_result
from tests.unit.test_workload_contract import nanogpt_dir

pytestmark = pytest.mark.distributed

WORKLOAD = str(DATA / "sgd_cosine.py")
STEPS, EVAL_EVERY, EVERY = 12, 3, 4  # evaluations at 3, 6, 9, 12; checkpoints at 4 and 8
# two warm-up steps: the second is the one each rank samples for its live tensor bytes
BASE = ("--precision", "fp32", "--steps", str(STEPS), "--warmup-steps", "2", "--no-calibrate")
DDP = ("--gpus", "2", "--strategy", "ddp", "--micro-batch", "2", "--grad-accum", "2")
LR, WARMUP, TOTAL = 0.2, 3, 12  # sgd_cosine.py's DEFAULTS


def lr_after(steps: int) -> float:
    """The learning rate after `steps` optimizer steps (sgd_cosine.py's schedule)."""
    if steps < WARMUP:
        return LR * (steps + 1) / WARMUP
    progress = min(1.0, (steps - WARMUP) / (TOTAL - WARMUP))
    return LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(run_dir: Path, *args: str, workload_args: tuple[str, ...] = ()) -> Path:
    """A finished run of sgd_cosine.py in `run_dir` (torchrun's files in its parent)."""
    done = run_dlaunch("run", WORKLOAD, *BASE, *args, "--run-dir", str(run_dir), "--",
                       *workload_args, env={"OMP_NUM_THREADS": "1", "TMPDIR": str(run_dir.parent)})
    assert done.code == 0, done.out + done.err + log_tails(run_dir)
    return run_dir


def assert_memory_measured(run_dir: Path) -> None:
    """Every rank sampled its live tensor bytes (runtime.live_bytes), and the summary says so."""
    from launcher.results.aggregate import aggregate
    from launcher.results.table import format_run

    ranks = run_result(run_dir)["ranks"]
    assert all(r["live_peak_bytes"] and r["live_peak_step"] == 2 for r in ranks), ranks
    [line] = [x for x in format_run(aggregate(run_dir)).splitlines() if x.startswith("memory")]
    assert "live tensors at peak (step 2" in line and "not measured" not in line, line


def evals(run_dir: Path, rank: int = 0) -> dict[int, dict[str, float]]:
    return {r["step"]: r["eval"] for r in rank_records(run_dir, rank) if r["kind"] == "step" and "eval" in r}


def assert_same_losses(reference: list[tuple[int, float]], got: list[tuple[int, float]],
                       rel: float) -> None:
    assert [s for s, _ in got] == [s for s, _ in reference], (reference, got)
    worst = max(abs(a - b) / abs(a) for (_, a), (_, b) in zip(reference, got))
    assert worst < rel, (worst, reference, got)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory):
    """DDP, 2 ranks, 2 micro-batches per step, evaluated every 3 steps: the reference."""
    return train(tmp_path_factory.mktemp("ddp") / "run", *DDP, "--eval-every", str(EVAL_EVERY))


def test_own_optimizer_and_schedule_under_ddp_with_accumulation(ddp):
    for rank in (0, 1):
        got = evals(ddp, rank)
        assert sorted(got) == [3, 6, 9, 12]
        for step, metrics in got.items():
            assert metrics["lr"] == pytest.approx(lr_after(step), rel=1e-12), (step, metrics)
            assert metrics["momentum_share"] == 1.0  # SGD's momentum buffers: the workload's optimizer
            assert math.isfinite(metrics["val_loss"])
    summary = json.loads(RunPaths(root=ddp).summary(0).read_text())
    assert summary["eval"]["step"] == 12 and summary["eval"]["lr"] == pytest.approx(lr_after(12))
    result = json.loads(RunPaths(root=ddp).result.read_text())
    assert result["last_eval"]["step"] == 12 and result["last_eval"]["lr"] == pytest.approx(lr_after(12))
    assert all(math.isfinite(loss) for _, loss in rank_steps(ddp))


@pytest.mark.parametrize("args", [
    ("--gpus", "2", "--strategy", "fsdp_full", "--micro-batch", "4"),
    ("--gpus", "2", "--strategy", "hybrid", "--shard-group-size", "1", "--micro-batch", "2",
     "--grad-accum", "2"),
], ids=["fsdp_full", "hybrid-2x1"])
def test_fsdp_and_hybrid_train_as_ddp_does(ddp, tmp_path, args):
    run_dir = train(tmp_path / "run", *args, "--eval-every", str(EVAL_EVERY))
    assert_same_losses(rank_steps(ddp), rank_steps(run_dir), 1e-5)
    assert {s: m["lr"] for s, m in evals(run_dir).items()} == pytest.approx(
        {s: m["lr"] for s, m in evals(ddp).items()})
    assert all(m["momentum_share"] == 1.0 for m in evals(run_dir).values())
    assert_memory_measured(run_dir)  # FSDP2's shards and unsharded parameters are seen


def test_compiled_training_uses_the_same_optimizer_and_schedule(ddp, tmp_path):
    """One process, compiled, the global batch as 4 x 2 accumulation: the same losses."""
    run_dir = train(tmp_path / "run", "--gpus", "1", "--strategy", "ddp", "--compile",
                    "--micro-batch", "4", "--grad-accum", "2")
    assert run_result(run_dir)["ranks"][0]["compiled_graphs"] >= 1
    assert_same_losses(rank_steps(ddp), rank_steps(run_dir), 1e-4)
    assert_memory_measured(run_dir)  # the buffers Inductor's code allocates are seen


def test_resume_after_a_killed_rank_restores_the_schedule(ddp, tmp_path):
    """Rank 1 SIGKILLs itself during step 10 (its 19th loss_fn call: 2 per step); the restart
    resumes from step 8 with the optimizer's momentum and the scheduler's position."""
    run_dir = train(tmp_path / "run", *DDP, "--eval-every", str(EVAL_EVERY),
                    "--checkpoint-every", str(EVERY), "--max-restarts", "1",
                    workload_args=("--fault", "sigkill", "--fault-rank", "1", "--fault-step", "19",
                                   "--fault-attempt", "0"))
    assert run_result(run_dir)["attempts"] == 2
    assert (RunPaths(root=run_dir).checkpoints / "step-000008" / "scheduler.pt").is_file()
    reference = rank_steps(ddp)
    for rank in (0, 1):
        resume = next(r for r in rank_records(run_dir, rank) if r["kind"] == "resume")
        assert resume["step"] == 8
        assert rank_steps(run_dir, rank) == reference[8:]  # fp32, same data: bit for bit
        assert evals(run_dir, rank) == {s: m for s, m in evals(ddp, rank).items() if s > 8}


def test_a_nanogpt_style_workload_runs_unchanged(dlaunch, tmp_path):
    """Planned in the launcher (profile), trained in the rank, samples read by a worker: each
    imports a neighbour of the workload file."""
    train_py = nanogpt_dir(tmp_path / "nanogpt")
    run_dir = tmp_path / "run"
    done = dlaunch("run", str(train_py), "--steps", "3", "--warmup-steps", "1", "--num-workers", "1",
                   "--no-calibrate", "--run-dir", str(run_dir), cwd=tmp_path,
                   env={"OMP_NUM_THREADS": "1"})
    assert done.code == 0, done.out + done.err + log_tails(run_dir)
    assert "plan:" in done.err + done.out
    assert [s for s, _ in rank_steps(run_dir)] == [1, 2, 3]

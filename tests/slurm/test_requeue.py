"""`scontrol requeue` in the middle of a `dlaunch run --slurm`, on the real local cluster: the
job resumes from its last checkpoint, completes, and its losses — the final one included —
equal an uninterrupted run's (same seeds, fp32)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.rundir import RunPaths

from tests.helpers import DATA, log_tails, rank_records, run_dlaunch, run_result, step_losses

pytestmark = pytest.mark.slurm

STEPS, EVERY = 20, 5
PLAN = ("--steps", str(STEPS), "--log-every", "2", "--strategy", "ddp", "--precision", "fp32",
        "--micro-batch", "4", "--grad-accum", "1", "--no-calibrate")
# a short sequence keeps steps cheap; the pause makes the run long enough to requeue mid-way
WORKLOAD = (str(DATA / "gpt_fault.py"),)
WORKLOAD_ARGS = ("--", "--seq-len", "32")


def _diagnose(run_dir: Path, text: str) -> str:
    return text + log_tails(run_dir)


# two nodes, one rank each: the requeue path is one for every shape (SLURM requeues the whole
# job; each node's torchrun resumes from the same checkpoint), and across nodes it has the most
# to get wrong; one node with two ranks runs in test_backend.py's shapes
@pytest.mark.parametrize("nodes,procs", [(2, 1)], ids=["2x1"])
def test_requeue_resumes_from_the_last_checkpoint_with_the_uninterrupted_loss(slurm_cluster, tmp_path,
                                                                              nodes, procs):
    slurm_cluster.wait_idle()
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "OMP_NUM_THREADS": "1"}
    env.pop("DLAUNCH_DEBUG", None)
    run_dir = tmp_path / "run"
    paths = RunPaths(root=run_dir)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "launcher.cli.main", "run", *WORKLOAD, "--slurm", "--nodes", str(nodes),
         "--gpus", str(procs),
         *PLAN, "--checkpoint-every", str(EVERY), "--run-dir", str(run_dir), *WORKLOAD_ARGS,
         "--step-sleep-ms", "100"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    job_id = None
    try:
        deadline = time.monotonic() + 45
        while time.monotonic() < deadline and proc.poll() is None:
            if paths.slurm.is_file() and list(paths.checkpoints.glob("step-*/meta.json")):
                break
            time.sleep(0.1)
        else:
            proc.kill()
            pytest.fail(_diagnose(run_dir, f"no checkpoint within 45 s:\n{proc.communicate()[0]}"))
        job_id = json.loads(paths.slurm.read_text())["job_id"]
        requeued_at = time.monotonic()
        slurm_cluster.scontrol("requeue", job_id)
        # the uninterrupted run, while SLURM holds the requeued job back (cred_expire, ~11 s)
        ref = run_dlaunch("run", *WORKLOAD, "--gpus", "2", *PLAN, "--run-dir", str(tmp_path / "ref"),
                          *WORKLOAD_ARGS, cwd=tmp_path, env={"TMPDIR": str(tmp_path / "tmp"),
                                                             "OMP_NUM_THREADS": "1"}, timeout=120)
        text, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            if job_id:
                slurm_cluster.run(["scancel", job_id], check=False)
    took = time.monotonic() - t0
    assert ref.code == 0, ref.out + ref.err
    assert proc.returncode == 0, _diagnose(run_dir, text)
    assert "requeued (restart 1)" in text and f"job {job_id} COMPLETED" in text
    assert slurm_cluster.wait_sacct_state(job_id, "COMPLETED", "FAILED", "CANCELLED") == "COMPLETED"

    reference = step_losses(rank_records(tmp_path / "ref", 0))
    for rank in (0, 1):
        records = rank_records(run_dir, rank)
        starts = [i for i, r in enumerate(records) if r["kind"] == "start"]
        assert [records[i]["attempt"] for i in starts] == [0, 1], records
        first, last = records[:starts[1]], records[starts[1]:]
        # the first attempt's newest checkpoint (periodic, or the one saved on SLURM's SIGTERM
        # when it was fast enough) is where the second one went on
        saved = [r["step"] for r in first if r["kind"] == "checkpoint"]
        resume = next(r for r in last if r["kind"] == "resume")
        assert saved and resume["step"] == max(saved) and resume["same_data_order"], (saved, resume)
        k = resume["step"]
        assert [s for s, _ in step_losses(last)] == list(range(k + 1, STEPS + 1))
        # same seeds, same data order, fp32: the same losses as the uninterrupted run
        assert step_losses(first)[:k] == reference[:k]
        assert step_losses(last) == reference[k:]
    result = run_result(run_dir)
    assert result["status"] == "ok" and result["attempts"] == 2
    assert all(r["steps"] == STEPS and r["resumed_from_step"] == k for r in result["ranks"])
    assert result["ranks"][0]["final_loss"] == reference[-1][1]
    if nodes > 1:  # both attempts really spread over both nodes
        assert {r["host"] for r in result["ranks"]} == set(slurm_cluster.nodes[:nodes])
    print(f"\nrequeue test ({nodes}x{procs}): checkpoint->requeue at {requeued_at - t0:.1f} s, resumed from step {k}, "
          f"total {took:.1f} s")

"""Tensor parallelism x FSDP (`--tp`, runtime.wrap) with real processes on gloo (issue 27).

workloads/gpt.py `tiny` (sequence length 32) on 4 CPU ranks as a (dp 2 x tp 2) mesh, fsdp_full,
fp32, gradient clipping on, 20 steps, against DDP on 2 ranks: the same global batch (2 x 2) in
the same order (the tp ranks of a group read their dp rank's samples), so the losses agree to
fp32 rounding (6e-8 relative measured). The same run with a fault in step 12 and a restart
resumes from the step-8 checkpoint (DCP, DTensor state on the 2-D mesh) with the uninterrupted
run's steps and losses (to 1e-5 relative: the resumed collectives may sum in another order).
The three runs start at once (one fixture).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch

from tests.helpers import DATA, WORKLOADS, rank_records, rank_steps, run_dlaunch_together, run_result

STEPS, EVERY, FAULT_STEP = 20, 8, 12
COMMON = ("--steps", str(STEPS), "--precision", "fp32", "--micro-batch", "2", "--warmup-steps", "0",
          "--max-grad-norm", "1.0")
TP = ("--gpus", "4", "--strategy", "fsdp_full", "--tp", "2", *COMMON)
DDP = ("--gpus", "2", "--strategy", "ddp", "--no-calibrate", *COMMON)
SEQ = ("--seq-len", "32")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, int, str]]:
    root = tmp_path_factory.mktemp("tp")
    (root / "tmp").mkdir()
    gpt = str(WORKLOADS / "gpt.py")
    return run_dlaunch_together({
        "ddp": (["run", gpt, *DDP, "--", *SEQ], root / "ddp"),
        # calibrated (after the last step: the losses are unchanged by it)
        "tp": (["run", gpt, *TP, "--checkpoint-every", str(EVERY), "--", *SEQ], root / "tp"),
        "fault": (["run", str(DATA / "gpt_tp_fault.py"), *TP, "--no-calibrate", "--checkpoint-every",
                   str(EVERY), "--max-restarts", "1", "--", *SEQ, "--fault", "raise", "--fault-step",
                   str(FAULT_STEP), "--fault-attempt", "0"], root / "fault"),
    }, root / "tmp", timeout=240)


@pytest.mark.distributed
def test_tp2_x_dp2_matches_ddp_on_the_same_global_batch(runs):
    ddp_dir, code, text = runs["ddp"]
    assert code == 0, text
    tp_dir, code, text = runs["tp"]
    assert code == 0, text
    reference = [loss for _, loss in rank_steps(ddp_dir)]
    assert len(reference) == STEPS
    for rank in range(4):  # every rank records the dp-averaged loss
        got = [loss for _, loss in rank_steps(tp_dir, rank)]
        worst = max(abs(a - b) / abs(a) for a, b in zip(reference, got))
        assert len(got) == STEPS and worst < 1e-5, (worst, reference, got)
    records = rank_records(tp_dir)
    wrap = next(r for r in records if r["kind"] == "wrap")
    assert (wrap["mesh_shape"], wrap["mesh_dims"], wrap["tp"], wrap["dp"]) == ([2, 2], ["dp", "tp"], 2, 2)
    comm = next(r for r in records if r["kind"] == "comm")
    assert "error" not in comm and comm["exposed_comm_dims"] == ["dp"], comm
    assert comm["exposed_comm_s"] >= 0 and comm["busbw_gb_s"] > 0, comm
    # TP's own collectives, timed apart: sequence parallel's all-gather and reduce-scatter around
    # attention and the MLP in each of the 2 blocks, forward and backward, plus the head's gather
    assert comm["tp_comm_s"] > 0 and comm["tp_collectives"] >= 2 * 4 * 2, comm
    per_rank = [next(r for r in rank_records(tp_dir, k) if r["kind"] == "comm")["tp_comm_s"] for k in range(4)]
    assert run_result(tp_dir)["tp_comm_s"] == pytest.approx(statistics.median(per_rank))
    # the summary prints the two dimensions' communication apart
    assert "ms exposed per step by data parallelism (sync-off calibration)" in text, text[-3000:]
    assert "ms per step in tensor parallelism's collectives" in text, text[-3000:]


@pytest.mark.distributed
def test_tp_restart_resumes_from_the_checkpoint_with_uninterrupted_losses(runs):
    ref_dir, code, text = runs["tp"]
    assert code == 0, text
    run_dir, code, text = runs["fault"]
    assert code == 0, text
    assert "restarting" in text
    reference = rank_steps(ref_dir)
    for rank in range(4):
        records = rank_records(run_dir, rank)
        resume = next(r for r in records if r["kind"] == "resume")
        assert resume["step"] == EVERY and resume["same_data_order"] is True
        resumed = rank_steps(run_dir, rank)
        assert [s for s, _ in resumed] == list(range(EVERY + 1, STEPS + 1))
        # the same steps and data; losses equal to fp32 rounding (the resumed process's
        # collectives may sum in another order: 1e-7 relative seen)
        ref = reference[EVERY:]
        assert [s for s, _ in resumed] == [s for s, _ in ref]
        assert [loss for _, loss in resumed] == pytest.approx([loss for _, loss in ref], rel=1e-5), (resumed, ref)


def _load_gpt():
    import importlib.util

    spec = importlib.util.spec_from_file_location("dlaunch_test_gpt_tp", WORKLOADS / "gpt.py")
    gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpt)
    return gpt


def test_gpt_tp_plan_degrees_and_styles():
    from types import SimpleNamespace

    gpt = _load_gpt()

    def model(**kw):
        cfg = SimpleNamespace(**{**gpt.DEFAULTS, **kw})
        with torch.device("meta"):
            return gpt.build_model(cfg)

    tiny = model()  # 4 heads, ffn 768, vocab 2048
    assert gpt.tp_plan(tiny, 3) is None and gpt.tp_plan(tiny, 8) is None
    plan = gpt.tp_plan(tiny, 2)
    assert {"embed", "head", "norm", "layers.*.attn.wq", "layers.*.w3"} <= set(plan) and "pos" not in plan
    assert gpt.tp_plan(model(kv_heads=2), 4) is None  # kv heads 2: at most tp 2
    mpt = model(size="mpt-125m", layers=1)  # learned positions, GELU, tied head
    plan = gpt.tp_plan(mpt, 4)
    assert "pos" in plan and "layers.*.w3" not in plan
    assert mpt.head.weight is mpt.embed.weight

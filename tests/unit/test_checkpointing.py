"""Activation checkpointing modes: their prices (launcher.plan.checkpointing), the planner's choice
among them, the flag, and the runtime applying each without changing what is computed."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from launcher.cli.main import build_parser
from launcher.cli.options import PlanOptions, RunOptions, load
from launcher.errors import PlanError, UsageError
from launcher.plan.checkpointing import (
    SELECTIVE_MATMUL_RECOMPUTED,
    SELECTIVE_SAVED_SHARE,
    kept_activation_bytes,
    recompute_share,
)
from launcher.plan.cost import forward_pass, step_time
from launcher.plan.explain import label
from launcher.plan.memory import estimate_memory
from launcher.plan.search import plan
from launcher.plan.types import Overrides
from launcher.runspec import LaunchSpec
from launcher.runtime.wrap import _checkpoint_blocks
from launcher.specs import (
    CHECKPOINTING,
    GIB,
    Goal,
    Strategy,
)
from launcher.workload import load_workload

from tests.unit.test_planner import GPT_1_3B, LLAMA3_8B, topology

# gpt tiny's shape, narrower: a Llama block (RMSNorm, SwiGLU, rotary), 4 of them
SMALL = ["--size", "tiny", "--dim", "64", "--heads", "2", "--kv-heads", "2", "--ffn", "192", "--vocab", "256"]
REPO_WORKLOADS = str(Path(__file__).resolve().parents[2] / "workloads" / "gpt.py")


# --- the table (pure) ---------------------------------------------------------------------------
def test_recompute_share_by_mode_from_the_forwards_split():
    split = dict(matmul_s=6.0, attention_s=2.0, memory_bound_s=2.0)
    assert recompute_share("none", num_blocks=4, **split) == 0.0
    assert recompute_share("full", num_blocks=4, **split) == pytest.approx(1.0)
    # every second block: 2 of 4, and 2 of 5 (blocks 2 and 4)
    assert recompute_share("every-other", num_blocks=4, **split) == pytest.approx(0.5)
    assert recompute_share("every-other", num_blocks=5, **split) == pytest.approx(0.4)
    # selective: the memory-bound work and its share of the matmuls; attention's output is saved
    assert recompute_share("selective", num_blocks=4, **split) == pytest.approx(
        (SELECTIVE_MATMUL_RECOMPUTED * 6.0 + 2.0) / 10.0)
    assert recompute_share("full", num_blocks=0, **split) == 0.0  # nothing to wrap
    with pytest.raises(PlanError, match="selective, every-other, full"):
        recompute_share("some", num_blocks=4, **split)


def test_kept_bytes_by_mode():
    saved, block_input, n = 1000.0, 10.0, 10  # 100 per block
    kept = {m: kept_activation_bytes(m, saved_bytes=saved, block_input_bytes=block_input, num_blocks=n)
            for m in CHECKPOINTING}
    assert kept["none"] == saved
    assert kept["full"] == pytest.approx(n * block_input + 100)  # inputs + one block recomputed
    assert kept["every-other"] == pytest.approx(5 * 100 + 5 * block_input + 100)
    s = SELECTIVE_SAVED_SHARE
    assert kept["selective"] == pytest.approx(n * (block_input + s * 100) + (1 - s) * 100)
    assert kept["none"] > kept["every-other"] > kept["selective"] > kept["full"]


# --- the cost model and the planner -------------------------------------------------------------
def test_selective_and_every_other_cost_less_than_full_on_a_gpu():
    topo = topology("h100-sxm-8x")
    times = {m: step_time(LLAMA3_8B, Strategy(kind="fsdp_full", precision="bf16", checkpointing=m),
                          topo, 2, 1).compute_s for m in CHECKPOINTING}
    assert times["none"] < times["selective"] < times["full"]
    assert times["none"] < times["every-other"] < times["full"]
    fwd = forward_pass(LLAMA3_8B, Strategy(kind="fsdp_full", precision="bf16"), 2, topo.accelerator)
    assert times["full"] - times["none"] == pytest.approx(fwd.total_s, rel=1e-6)


def _headroom_for(usable_bytes: float, mem_gib: float) -> float:
    return 1.0 - usable_bytes / (mem_gib * GIB)


@pytest.mark.parametrize("fits_up_to,chosen", [("selective", "selective"), ("full", "full")])
def test_the_planner_takes_the_lightest_mode_that_fits(fits_up_to: str, chosen: str):
    topo = topology("h100-sxm-8x")
    forced = Overrides(strategy="fsdp_full", micro_batch=4)
    mem = {m: estimate_memory(GPT_1_3B, Strategy(kind="fsdp_full", precision="bf16", checkpointing=m),
                              micro_batch=4, world_size=8, shard_group_size=8, device="cuda").total_bytes
           for m in CHECKPOINTING}
    # budgets just above the mode that must fit: below every lighter one
    usable = mem[fits_up_to] * 1.001
    assert all(mem[m] > usable for m in CHECKPOINTING[:CHECKPOINTING.index(fits_up_to)])
    goal = Goal(global_batch=256, headroom=_headroom_for(usable, topo.accelerator.mem_gib))
    p = plan(GPT_1_3B, topo, goal, overrides=forced)
    assert p.chosen.fits and p.chosen.strategy.checkpointing == chosen
    why = "\n".join(p.reasons)
    assert "activation checkpointing, " in why and "without it FSDP full does not fit" in why
    if chosen == "full":
        assert "selective needs" in why and "every-other needs" in why
    assert label(p.chosen).endswith("+ ckpt" if chosen == "full" else "+ sel-ckpt")


def test_with_room_for_everything_no_checkpointing_and_forced_modes_are_kept():
    topo = topology("h100-sxm-8x")
    p = plan(GPT_1_3B, topo, Goal(global_batch=256), overrides=Overrides(strategy="fsdp_full", micro_batch=1))
    assert p.chosen.strategy.checkpointing == "none"
    forced = plan(GPT_1_3B, topo, Goal(global_batch=256),
                  overrides=Overrides(strategy="fsdp_full", micro_batch=1, checkpointing="every-other"))
    assert forced.chosen.strategy.checkpointing == "every-other"
    # old files hold a bool: true is every block
    legacy = plan(GPT_1_3B, topo, Goal(global_batch=256),
                  overrides=Overrides(strategy="fsdp_full", micro_batch=1, checkpointing=True))
    assert legacy.chosen.strategy.checkpointing == "full"


# --- flags and specs ------------------------------------------------------------------------------
def test_the_flag_takes_a_mode_for_plan_and_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    parser = build_parser()
    assert load(PlanOptions, parser.parse_args(["plan", "w.py", "--checkpointing", "selective"])
                ).settings.checkpointing == "selective"
    assert load(RunOptions, parser.parse_args(["run", "w.py", "--checkpointing", "every-other"])
                ).settings.checkpointing == "every-other"
    assert load(RunOptions, parser.parse_args(["run", "w.py"])).settings.checkpointing is None  # the plan's
    with pytest.raises(UsageError, match="invalid choice: 'half'"):
        parser.parse_args(["run", "w.py", "--checkpointing", "half"])


def test_a_spec_written_before_the_modes_reads_back():
    spec = LaunchSpec(workload="/w.py", run_id="r", run_dir="/r", checkpointing="selective")
    assert LaunchSpec.from_dict(spec.to_dict()).checkpointing == "selective"
    old = {k: v for k, v in spec.to_dict().items() if k not in ("strategy", "checkpointing")}
    old["strategy"] = {"kind": spec.strategy, "activation_checkpointing": True}  # as written then
    assert LaunchSpec.from_dict(old).checkpointing == "full"


# --- the runtime ----------------------------------------------------------------------------------
def test_every_mode_computes_the_same_loss_and_gradients():
    w = load_workload(REPO_WORKLOADS, [*SMALL, "--seq-len", "16"])
    torch.manual_seed(0)
    base = w.build_model()
    batch = torch.stack([w.make_dataset(2)[i] for i in range(2)])
    results = {}
    for mode in CHECKPOINTING:
        model = copy.deepcopy(base)
        if mode != "none":
            wrapped = _checkpoint_blocks(model, w.blocks(model), mode)
            kinds = [type(b).__name__ for b in wrapped]
            assert kinds.count("CheckpointWrapper") == (2 if mode == "every-other" else 4)
        loss = w.loss_fn(model, batch)
        loss.backward()
        results[mode] = (loss.detach(), [p.grad for p in model.parameters()])
    ref_loss, ref_grads = results["none"]
    for loss, grads in results.values():
        torch.testing.assert_close(loss, ref_loss)
        for g, ref in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g, ref)


def test_the_profile_measures_what_selective_keeps_of_a_block():
    # SMALL with grouped KV heads (4 heads, 2 KV): width 64, KV width 32, MLP 192, 8 tokens, fp32.
    # The save list keeps wq (64), wv (32), w1 (192) and w2 (64) of the 7 matmuls, and SDPA's
    # output (64) with its log-sum-exp (one fp32 a head a token): 420 B a token
    from launcher.plan.profile_passes import measure

    w = load_workload(REPO_WORKLOADS, [*SMALL, "--heads", "4", "--seq-len", "8", "--layers", "1"])
    with torch.device("meta"):
        model = w.build_model()
    keys = {p.untyped_storage()._cdata for p in model.parameters()}
    counts = measure(w, model, keys, w.blocks(model)[0], transients=False)
    assert counts.block_selective == 4 * 8 * (64 + 32 + 192 + 64 + 64 + 4)
    assert 0.2 < counts.block_selective / counts.block_saved < 0.5
    # the memory model keeps that share of each selective block, not the 0.4 of an unmeasured profile
    saved, block_input, n = 1000.0, 10.0, 10
    measured = kept_activation_bytes("selective", saved_bytes=saved, block_input_bytes=block_input, num_blocks=n,
                                     selective_share=0.25)
    assert measured == pytest.approx(n * (block_input + 25) + 75)
    assert kept_activation_bytes("full", saved_bytes=saved, block_input_bytes=block_input, num_blocks=n,
                                 selective_share=0.25) == pytest.approx(n * block_input + 100)


def test_selective_saves_every_other_matmul_and_attention(monkeypatch):
    import torch.utils.checkpoint as ckpt

    decisions: list[tuple[str, str]] = []
    make = ckpt.create_selective_checkpoint_contexts

    def spy(policy, *args, **kwargs):
        def watched(ctx, func, *a, **k):
            out = policy(ctx, func, *a, **k)
            if not ctx.is_recompute:
                decisions.append((str(func), out.name))
            return out
        return make(watched, *args, **kwargs)

    from launcher.runtime import wrap

    monkeypatch.setattr(wrap, "create_selective_checkpoint_contexts", spy)
    w = load_workload(REPO_WORKLOADS, [*SMALL, "--seq-len", "8", "--layers", "1"])
    model = w.build_model()
    _checkpoint_blocks(model, w.blocks(model), "selective")
    w.loss_fn(model, torch.stack([w.make_dataset(1)[0]])).backward()
    mms = [d for f, d in decisions if f == "aten.mm.default"]
    # a Llama block's 7 matmuls: wq, wv, w1, w2 saved; wk, wo, w3 recomputed
    assert mms == ["MUST_SAVE", "PREFER_RECOMPUTE"] * 3 + ["MUST_SAVE"]
    assert ("aten._scaled_dot_product_flash_attention_for_cpu.default", "MUST_SAVE") in decisions
    assert all(d == "PREFER_RECOMPUTE" for f, d in decisions if "silu" in f or "mean" in f)

"""Float8 in the plan: weighed on GPUs with float8 tensor cores, priced from torchao's kernel
measurements, checked against torchtitan's published float8/bf16 pairs; and which layers the
runtime converts."""

from __future__ import annotations

import pytest
import torch

from launcher.errors import PlanError
from launcher.hardware.topology import load_topology
from launcher.plan.collectives import AMAX_BYTES, fsdp_traffic, group_collectives, split
from launcher.plan.float8 import converted_share, fsdp_float8_gather, passes
from launcher.plan.search import plan
from launcher.plan.types import Overrides
from launcher.plan.view import format_plan
from launcher.runtime.float8 import eligible
from launcher.specs import Goal, Strategy

from tests.helpers import published_runner
from tests.unit.test_planner import GPT_125M, gpt

LLAMA3_8B = gpt("llama3-8b", 4096, 32, 32, 128256, 2048, params=8.03e9, tied=False)


def test_each_published_float8_pair_is_predicted_within_10_percent():
    pairs = published_runner().float8_pairs()
    assert len(pairs) >= 2
    for rid, published, planned in pairs:
        assert published > 1.2 and abs(planned / published - 1) < 0.10, (rid, published, planned)


def test_torchaos_filter_decides_the_converted_share():
    assert passes("tensorwise", 4096, 4096) and not passes("tensorwise", 2048, 1024)
    assert not passes("tensorwise", 4096, 4100)  # not a multiple of 16
    assert not passes("rowwise", 4096, 2048) and passes("rowwise", 4096, 8192)
    assert converted_share(LLAMA3_8B, "tensorwise") == pytest.approx(1.0)
    # a 768-wide GPT: only the MLP's up projection passes tensorwise's thresholds, none rowwise's
    assert converted_share(GPT_125M, "tensorwise") == pytest.approx(4 / 12)
    assert converted_share(GPT_125M, "rowwise") == 0


def test_an_h100_plan_weighs_float8_and_states_its_gain():
    topo = load_topology("h100-sxm-8x")
    p = plan(LLAMA3_8B, topo, Goal())
    assert p.chosen.strategy.float8 == "tensorwise" and p.chosen.strategy.precision == "bf16"
    why = next(r for r in p.reasons if r.startswith("float8 (tensorwise)"))
    assert "s/step predicted (+" in why and "needs torchao" in why
    assert "bf16 + float8 (tensorwise)" in format_plan(p, LLAMA3_8B, topo)
    bf16 = plan(LLAMA3_8B, topo, Goal(), overrides=Overrides(float8="none"))
    assert bf16.chosen.strategy.float8 == "none"
    assert p.units_per_s > 1.1 * bf16.units_per_s


def test_a_faster_float8_twin_left_unused_says_why():
    # DDP forced where neither fits: float8 is faster but too big, not a tie
    p = plan(LLAMA3_8B, load_topology("h100-sxm-8x"), Goal(), overrides=Overrides(strategy="ddp"))
    assert not p.chosen.fits and p.chosen.strategy.float8 == "none"
    why = next(r for r in p.reasons if r.startswith("float8: weighed, not used"))
    assert "throughput, but it does not fit)" in why and "tie" not in why


def test_fsdp_gathers_the_converted_weights_in_float8_after_their_amax_all_reduces():
    topo = load_topology("h100-sxm-8x")
    ops = group_collectives(topo)

    def traffic(kind: str, float8: str, t=topo):
        return fsdp_traffic(LLAMA3_8B, Strategy(kind=kind, precision="bf16", float8=float8), t)

    bf16, f8 = traffic("fsdp_full", "none"), traffic("fsdp_full", "tensorwise")
    blocks = LLAMA3_8B.num_blocks * LLAMA3_8B.largest_block_params  # every block linear converts
    # each block's six converted weights: one amax all-reduce each before every gather
    amax = LLAMA3_8B.num_blocks * 6 * ops["ar"](AMAX_BYTES)
    assert f8["ag_fwd"] == pytest.approx(split(ops["ag"], 2 * LLAMA3_8B.num_params - blocks, bf16["units"]) + amax)
    assert f8["ag_bwd"] < bf16["ag_bwd"] and f8["rs"] == bf16["rs"]  # gradients reduce in fp32
    # rowwise gathers bf16, and neither DDP nor an A100 gathers anything in float8
    assert traffic("fsdp_full", "rowwise") == bf16
    assert fsdp_float8_gather(LLAMA3_8B, Strategy(kind="ddp", precision="bf16", float8="tensorwise"),
                              topo.accelerator) == (0.0, 0)
    a100 = load_topology("a100-sxm-8x")
    assert traffic("fsdp_full", "tensorwise", a100) == traffic("fsdp_full", "none", a100)


def test_float8_is_not_weighed_without_float8_tensor_cores_or_on_cpu():
    a100 = plan(LLAMA3_8B, load_topology("a100-sxm-8x"), Goal())
    assert a100.chosen.strategy.float8 == "none"
    assert any("no float8 tensor cores (compute capability 8.0 < 8.9)" in r for r in a100.reasons)
    # forced there, it is one line, not a plan that would fail inside torchao
    with pytest.raises(PlanError, match=r"A100-SXM4-80GB has none \(compute capability 8.0\): drop --float8"):
        plan(LLAMA3_8B, load_topology("a100-sxm-8x"), Goal(), overrides=Overrides(float8="tensorwise"))
    cpu = plan(GPT_125M, load_topology("cpu-local"), Goal())
    assert cpu.chosen.strategy.float8 == "none"
    with pytest.raises(PlanError, match="--float8 tensorwise runs the linear layers' GEMMs in float8"):
        Overrides(float8="tensorwise", precision="fp32")


def test_the_runtime_converts_the_blocks_linears_but_not_the_head_or_odd_shapes():
    model = torch.nn.ModuleDict({"up": torch.nn.Linear(64, 256), "odd": torch.nn.Linear(64, 24),
                                 "head": torch.nn.Linear(256, 1000)})
    convert, skipped = eligible(model, "tensorwise", "cpu")
    assert convert == ["up"]
    assert dict(skipped) == {"odd": "64x24: float8 GEMMs need multiples of 16",
                             "head": "the output head (kept in bf16 for the loss)"}
    # on a GPU torchao's speed thresholds apply too: 64x256 is too small to gain
    assert eligible(model, "tensorwise", "cuda")[0] == []


def test_the_command_line_names_the_float8_and_offload_flags():
    from launcher.cli.args import name_flags
    from launcher.specs import FLOAT8_NEEDS_BF16, OFFLOAD_NEEDS_FSDP

    assert name_flags(FLOAT8_NEEDS_BF16).startswith("--float8 runs the linear layers' GEMMs")
    assert "--precision bf16" in name_flags(FLOAT8_NEEDS_BF16)
    assert name_flags(OFFLOAD_NEEDS_FSDP).startswith("--offload keeps FSDP's sharded state")

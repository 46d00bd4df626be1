"""The planner on real machines and real model shapes: the seed rule must come out of the numbers.

Topologies are built here with the same numbers as topologies/*.yaml (so these tests do not move
when a file's prose changes); model profiles are analytic GPT/Llama shapes:
params 12*L*d^2 + vocab*d (or the published count), forward FLOPs 2*params*tokens, activations
per layer per sample s*h*(34 + 5*a*s/h) bytes at fp16 (Korthikanti et al. 2022), doubled because
profiles measure fp32 saved tensors, plus fp32 logits s*vocab*4.
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from launcher.alloc_conf import alloc_conf_name, installed_torch_version
from launcher.errors import DlaunchError, PlanError, UsageError
from launcher.hardware.topology import list_shipped, load_topology
from launcher.hardware.types import DeviceSpec, Link, Topology
from launcher.plan.candidates import STRATEGY_ORDER, TIE_TOLERANCE
from launcher.plan.explain import label
from launcher.plan.memory import estimate_memory
from launcher.plan.search import plan
from launcher.plan.types import Overrides
from launcher.plan.view import format_plan
from launcher.specs import CHECKPOINTING, FSDP_UNITS, GIB, Goal, ModelProfile, Strategy

# --- hardware (numbers from topologies/*.yaml) --------------------------------------------------
H100 = DeviceSpec(name="H100 SXM", mem_gib=79.6, compute_capability=(9, 0),
                  peak_tflops={"fp32": 67, "tf32": 495, "bf16": 989, "fp16": 989})
A100 = DeviceSpec(name="A100 80GB", mem_gib=80.0, compute_capability=(8, 0),
                  peak_tflops={"fp32": 19.5, "tf32": 156, "bf16": 312, "fp16": 312})
L40S = DeviceSpec(name="L40S", mem_gib=45.0, compute_capability=(8, 9),
                  peak_tflops={"fp32": 91.6, "tf32": 183, "bf16": 362, "fp16": 362})
RTX4090 = DeviceSpec(name="RTX 4090", mem_gib=23.99, compute_capability=(8, 9),
                     peak_tflops={"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2})
V100 = DeviceSpec(name="V100 SXM2 32GB", mem_gib=32.0, compute_capability=(7, 0),
                  peak_tflops={"fp32": 15.7, "fp16": 125})
T4 = DeviceSpec(name="T4", mem_gib=15.0, compute_capability=(7, 5),
                peak_tflops={"fp32": 8.1, "fp16": 65})
CPU = DeviceSpec(name="EPYC 2 vCPU / 4", mem_gib=5.88, peak_tflops={"fp32": 0.041, "bf16": 0.09})

NVSWITCH_H100 = Link(kind="nvswitch", bw_gb_s=370, latency_us=3)
NVSWITCH_A100 = Link(kind="nvswitch", bw_gb_s=230, latency_us=3)
PCIE4 = Link(kind="pcie", bw_gb_s=20, latency_us=6)
IB_NDR_8RAIL = Link(kind="infiniband", bw_gb_s=370, latency_us=5)
ROCE_1NIC = Link(kind="roce", bw_gb_s=9.5, latency_us=8)


def topology(name: str) -> Topology:
    """The shipped topologies, rebuilt in code."""
    one = dict(num_nodes=1, devices_per_node=8, device="cuda")
    specs = {
        "h100-sxm-8x": dict(one, accelerator=H100, intra_node=NVSWITCH_H100),
        "a100-sxm-8x": dict(one, accelerator=A100, intra_node=NVSWITCH_A100),
        "a100-pcie-8x": dict(one, accelerator=A100, intra_node=PCIE4),
        "l40s-pcie-8x": dict(one, accelerator=L40S, intra_node=PCIE4),
        "rtx4090-4x": dict(one, devices_per_node=4, accelerator=RTX4090,
                           intra_node=Link(kind="pcie-nop2p", bw_gb_s=12, latency_us=10)),
        "v100-sxm-8x": dict(one, accelerator=V100,
                            intra_node=Link(kind="nvlink", bw_gb_s=120, latency_us=3)),
        "t4-4x": dict(one, devices_per_node=4, accelerator=T4,
                      intra_node=Link(kind="pcie", bw_gb_s=10, latency_us=8)),
        "h100-sxm-8x4node-ib": dict(one, num_nodes=4, accelerator=H100,
                                    intra_node=NVSWITCH_H100, inter_node=IB_NDR_8RAIL),
        "h100-sxm-8x128node-ib": dict(one, num_nodes=128, accelerator=H100,
                                      intra_node=NVSWITCH_H100, inter_node=IB_NDR_8RAIL),
        "a100-sxm-8x2node-roce": dict(one, num_nodes=2, accelerator=A100,
                                      intra_node=NVSWITCH_A100, inter_node=ROCE_1NIC),
        "cpu-local": dict(num_nodes=1, devices_per_node=4, device="cpu", accelerator=CPU,
                          cpu_cores_per_node=2,
                          intra_node=Link(kind="shm", bw_gb_s=0.5, latency_us=110)),
    }
    return Topology(name=name, **specs[name])


# --- models ---------------------------------------------------------------------------------------
def gpt(name: str, d: int, layers: int, heads: int, vocab: int, seq: int, *,
        params: float | None = None, tied: bool = True) -> ModelProfile:
    """An analytic GPT/Llama profile (see the module docstring)."""
    root = vocab * d * (1 if tied else 2)
    p = int(params or 12 * layers * d * d + root)
    per_layer_fp16 = seq * d * (34 + 5 * heads * seq / d)
    return ModelProfile(
        name=name, num_params=p, bytes_by_dtype={"float32": 4 * p}, num_blocks=layers,
        largest_block_params=(p - root) // layers,
        activation_bytes_per_sample=2 * layers * per_layer_fp16 + seq * vocab * 4,
        block_input_bytes_per_sample=seq * d * 4, flops_fwd_per_sample=2 * p * seq,
        units_per_sample=seq, sample_units="tokens")


GPT_TINY = gpt("gpt-tiny", 256, 4, 4, 2048, 128)
GPT_125M = gpt("gpt-125m", 768, 12, 12, 50257, 2048)
GPT_1_3B = gpt("gpt-1.3b", 2048, 24, 16, 50257, 2048)
LLAMA3_8B = gpt("llama3-8b", 4096, 32, 32, 128256, 4096, params=8.03e9, tied=False)
LLAMA3_70B = gpt("llama3-70b", 8192, 80, 64, 128256, 4096, params=70.6e9, tied=False)

FSDP = {"fsdp_full", "fsdp_grad_op", "hybrid"}

# (id, model, topology, global batch, overrides, allowed strategies, precision, checkpointing
#  (None: either), regexes that must all match the joined reasons)
SCENARIOS = [
    ("125m-h100-ddp", GPT_125M, "h100-sxm-8x", 256, None, {"ddp"}, "bf16", False,
     [r"^DDP fits \(\d+\.\d GiB of 71\.6 usable\)", r"bf16 mixed precision"]),
    ("125m-h100-default-batch", GPT_125M, "h100-sxm-8x", None, None, {"ddp"}, "bf16", False,
     [r"no global batch given: micro-batch \d+"]),
    ("1.3b-a100-nvswitch-ddp", GPT_1_3B, "a100-sxm-8x", 256, None, {"ddp"}, "bf16", False,
     [r"^DDP fits"]),
    ("8b-h100-fsdp", LLAMA3_8B, "h100-sxm-8x", 64, None, FSDP - {"hybrid"}, "bf16", None,
     [r"DDP does not fit: \d+\.\d GiB/GPU > 71\.6 GiB usable",
      r"params\+grads\+optimizer 119\.7 GiB = 16 B/param"]),
    ("8b-4node-ib-full-vs-hybrid", LLAMA3_8B, "h100-sxm-8x4node-ib", 256, None,
     {"fsdp_full", "hybrid"}, "bf16",
     None, [r"FSDP full\b.*\d s/step", r"hybrid\b.*\d s/step", r"DDP does not fit"]),
    ("1.3b-4090-fsdp-ckpt", GPT_1_3B, "rtx4090-4x", 64, None, FSDP, "bf16", True,
     [r"DDP does not fit: .* > 21\.6 GiB usable", r"activation checkpointing, "]),
    ("125m-4090-nop2p-ddp", GPT_125M, "rtx4090-4x", 64, None, {"ddp"}, "bf16", False,
     [r"^DDP fits .* and is fastest: .* vs (FSDP|ZeRO-1)"]),
    ("125m-v100-fp16", GPT_125M, "v100-sxm-8x", 256, None, {"ddp"}, "fp16", False,
     [r"fp16 with GradScaler: .*compute capability 7\.0\) has no bf16"]),
    ("1.3b-t4-fp16-fsdp", GPT_1_3B, "t4-4x", 64, None, FSDP, "fp16", True,
     [r"fp16 with GradScaler", r"DDP does not fit"]),
    # ZeRO-1 ties: its parameter sync over PCIe costs about what its sharded optimizer saves
    ("125m-l40s-pcie-ddp", GPT_125M, "l40s-pcie-8x", 256, None, {"ddp"}, "bf16", False,
     [r"^DDP fits .* and (is fastest: .* vs|ties with) (FSDP|ZeRO-1)"]),
    # in bf16 (float8 on the L40S makes ZeRO-1's float8 twin the fastest: tests/unit/test_float8_plan.py)
    ("1.3b-l40s-pcie-ddp", GPT_1_3B, "l40s-pcie-8x", 256, Overrides(float8="none"), {"ddp"}, "bf16", False,
     [r"^DDP fits .* and (is fastest: .* vs|ties with) (FSDP|ZeRO-1)"]),
    # A100 PCIe and one RoCE NIC: FSDP's extra traffic costs ~2%, a tie DDP wins (the 125M
    # step is mostly memory-bound compute since the cost model splits compute by kind of work)
    ("125m-a100-pcie-ddp", GPT_125M, "a100-pcie-8x", 256, None, {"ddp"}, "bf16", False,
     [r"^DDP fits .* and (is fastest|ties with)"]),
    ("125m-roce-ddp", GPT_125M, "a100-sxm-8x2node-roce", 256, None, {"ddp"}, "bf16", False,
     [r"^DDP fits .* and (is fastest: .* vs|ties with) hybrid", r"FSDP full: "]),
    ("1.3b-roce-ddp-or-hybrid", GPT_1_3B, "a100-sxm-8x2node-roce", 256, None, {"ddp", "hybrid"},
     "bf16", False, [r"DDP", r"hybrid", r"is fastest|ties with hybrid"]),
    ("70b-1024-gpus-fsdp", LLAMA3_70B, "h100-sxm-8x128node-ib", 1024, None, {"fsdp_full"},
     "bf16", True, [r"only strategy that fits", r"hybrid does not fit", r"DDP does not fit"]),
    ("override-ddp-too-big", LLAMA3_8B, "h100-sxm-8x", 64, Overrides(strategy="ddp"), {"ddp"}, "bf16",
     None, [r"^warning: the forced plan does not fit: DDP", r"FSDP .* would fit",
            r"forced by overrides: strategy=ddp"]),
    ("override-fp32-fits", GPT_125M, "h100-sxm-8x", 256, Overrides(precision="fp32"), {"ddp"}, "fp32",
     None, [r"^DDP fits", r"forced by overrides: precision=fp32"]),
    # 4 ranks on 2 cores: sharding the memory-bound AdamW step and autocast's weight casts
    # competes with DDP's cheaper collectives (cpu_cost), so either may win
    ("cpu-tiny", GPT_TINY, "cpu-local", 32, None, {"ddp", "fsdp_grad_op"}, "bf16", False,
     [r"^(DDP|FSDP grad-op) fits", r"bf16 autocast on CPU"]),
]


@pytest.mark.parametrize(
    "model,topo_name,global_batch,overrides,kinds,precision,ckpt,patterns",
    [s[1:] for s in SCENARIOS], ids=[s[0] for s in SCENARIOS])
def test_scenario(model, topo_name, global_batch, overrides, kinds, precision, ckpt, patterns):
    topo = topology(topo_name)
    p = plan(model, topo, Goal(global_batch=global_batch), overrides=overrides)
    c = p.chosen
    why = "\n".join(p.reasons)
    assert c.strategy.kind in kinds, why
    assert c.strategy.precision == precision, why
    if ckpt is not None:
        assert c.strategy.recomputes is ckpt, why
    for pattern in patterns:
        assert re.search(pattern, why, re.MULTILINE), f"{pattern!r} not in:\n{why}"
    # the bookkeeping every plan must get right
    assert c.micro_batch * c.grad_accum * topo.world_size == p.global_batch
    if global_batch is not None:
        assert p.global_batch == global_batch
    assert c.fits == (not p.reasons[0].startswith("warning:"))
    assert 0 < p.scaling_efficiency <= 1
    assert p.units_per_s == pytest.approx(p.global_batch * model.units_per_sample
                                          / c.time.step_time_s)
    assert c.strategy.uses_grad_scaler == (precision == "fp16")


def test_a_forced_plan_inside_the_headroom_is_told_its_margin_not_that_it_cannot_run():
    # the same forced plan against a headroom it passes and against the card it does not fill
    topo = topology("h100-sxm-8x")
    forced = Overrides(strategy="ddp", precision="fp32", micro_batch=2, checkpointing="none", compile=False)
    roomy = plan(GPT_125M, topo, Goal(global_batch=256), overrides=forced)
    assert roomy.chosen.fits and not roomy.reasons[0].startswith("warning:")
    card = topo.accelerator.mem_gib * 2**30
    share = roomy.chosen.memory.total_bytes / card
    tight = plan(GPT_125M, topo, Goal(global_batch=256, headroom=1 - share / 2), overrides=forced)
    assert not tight.chosen.fits and tight.chosen.memory == roomy.chosen.memory
    assert re.match(r"warning: the forced plan leaves less than the \d+% headroom: DDP.*: "
                    r"\d+\.\d of 79\.\d GiB/GPU; it may run out of memory", tight.reasons[0]), tight.reasons[0]


def test_linear_units_are_proposed_only_where_no_block_unit_fits():
    # GPT-1.3B's blocks as 4 linears (the largest the MLP's 4d x d) and a rest: a budget between the two
    # unit sizes' peaks leaves linear units the one fit; with room, blocks stay and no linear unit is priced
    profile = dataclasses.replace(GPT_1_3B, linear_unit_params=4 * 2048 * 2048, linear_units_per_block=5)
    topo = topology("h100-sxm-8x")
    forced = Overrides(strategy="fsdp_full", micro_batch=4, checkpointing="full")
    mem = {unit: estimate_memory(profile, Strategy(kind="fsdp_full", precision="bf16", checkpointing="full",
                                                   fsdp_unit=unit), micro_batch=4, world_size=8, shard_group_size=8,
                                 device="cuda").total_bytes for unit in FSDP_UNITS}
    assert mem["linear"] < mem["block"]
    tight = Goal(global_batch=256, headroom=1 - (mem["linear"] + mem["block"]) / 2 / (topo.accelerator.mem_gib * GIB))
    p = plan(profile, topo, tight, overrides=forced)
    assert p.chosen.fits and p.chosen.strategy.fsdp_unit == "linear" and not p.chosen.strategy.compile
    assert "FSDP units: each linear layer of a block and the block's rest (121 units)" in p.reasons[1]
    assert label(p.chosen).startswith("FSDP full") and label(p.chosen).endswith(" + ckpt + linear units")
    roomy = plan(profile, topo, Goal(global_batch=256), overrides=forced)
    assert roomy.chosen.strategy.fsdp_unit == "block" and {c.strategy.fsdp_unit for c in roomy.rejected} <= {"block"}
    # given, it is kept where blocks would fit; under --tp, --compile or selective checkpointing it is one line
    assert plan(profile, topo, Goal(global_batch=256), overrides=dataclasses.replace(
        forced, fsdp_unit="linear")).chosen.strategy.fsdp_unit == "linear"
    for bad in ({"tp": 2}, {"compile": True}, {"strategy": "ddp"}, {"checkpointing": "selective"}):
        with pytest.raises(PlanError, match="`fsdp_unit` linear shards each linear layer"):
            Overrides(fsdp_unit="linear", **{"strategy": "fsdp_full", **bad})
    with pytest.raises(UsageError, match="`checkpointing` selective"):
        Strategy(kind="fsdp_full", checkpointing="selective", fsdp_unit="linear")
    # left to the plan, linear units come with whole-block checkpointing or none, never selective
    free = plan(profile, topo, tight, overrides=Overrides(strategy="fsdp_full", micro_batch=4, fsdp_unit="linear"))
    modes = {c.strategy.checkpointing for c in [free.chosen, *free.rejected]}
    assert modes == {"none", "every-other", "full"}, modes


def test_nothing_fits_raises_one_actionable_line():
    with pytest.raises(PlanError) as err:
        plan(LLAMA3_70B, topology("rtx4090-4x"), Goal(global_batch=16))
    msg = str(err.value)
    assert "\n" not in msg
    assert re.search(r"nothing fits on 4 x RTX 4090 .* needs \d+\.\d GiB per GPU", msg)
    assert "add GPUs or nodes" in msg


def _per_sample(c) -> float:
    return c.time.step_time_s / (c.micro_batch * c.grad_accum)


@pytest.mark.parametrize("topo_name", ["h100-sxm-8x", "l40s-pcie-8x", "a100-sxm-8x2node-roce"])
def test_sweep_picks_fastest_or_simplest_tie_and_ends_with_fsdp(topo_name):
    """As the model grows: small models get DDP, models whose DDP state cannot fit get FSDP,
    and every choice in between is the fastest fitting plan or the simplest within the tie."""
    order = list(STRATEGY_ORDER)
    seen = []
    for d, layers in [(768, 12), (1024, 24), (1536, 24), (2048, 24), (2560, 32), (3072, 32),
                      (4096, 32), (5120, 40)]:
        m = gpt(f"gpt-d{d}", d, layers, d // 128, 50257, 1024)
        p = plan(m, topology(topo_name), Goal(global_batch=128))
        fitting = [p.chosen] + [r for r in p.rejected if r.fits]
        best = min(_per_sample(c) for c in fitting)
        near = [c for c in fitting if _per_sample(c) <= best * 1.02]
        assert p.chosen in near, "\n".join(p.reasons)
        assert order.index(p.chosen.strategy.kind) == min(order.index(c.strategy.kind)
                                                          for c in near)
        seen.append(p.chosen.strategy.kind)
    assert seen[0] == "ddp" and seen[-1] != "ddp", seen


def test_fsdp_on_slow_links_loses_more_to_ddp():
    # the same 125M job: FSDP's extra exposure grows when the link is PCIe instead of NVSwitch
    def gap(name: str) -> float:
        p = plan(GPT_125M, topology(name), Goal(global_batch=256))
        assert p.chosen.strategy.kind == "ddp"
        fsdp = min(r.time.step_time_s for r in p.rejected
                   if r.fits and r.strategy.kind == "fsdp_full")
        return fsdp / p.chosen.time.step_time_s
    assert gap("l40s-pcie-8x") > gap("h100-sxm-8x") > 1.0


def test_8b_on_4_nodes_takes_the_faster_of_full_and_hybrid():
    p = plan(LLAMA3_8B, topology("h100-sxm-8x4node-ib"), Goal(global_batch=256))
    other = "hybrid" if p.chosen.strategy.kind == "fsdp_full" else "fsdp_full"
    best_other = min(r.time.step_time_s for r in p.rejected
                     if r.fits and r.strategy.kind == other)
    # the lower predicted step time, within the planner's stated tie tolerance
    assert p.chosen.time.step_time_s <= best_other * (1 + TIE_TOLERANCE)


def test_rejected_has_one_best_candidate_per_group_with_reasons():
    p = plan(LLAMA3_8B, topology("h100-sxm-8x4node-ib"), Goal(global_batch=256))
    groups = [(r.strategy.kind, r.strategy.precision, r.strategy.float8, r.strategy.checkpointing)
              for r in p.rejected]
    chosen = (p.chosen.strategy.kind, p.chosen.strategy.precision, p.chosen.strategy.float8,
              p.chosen.strategy.checkpointing)
    # an H100 prices every bf16 candidate also in float8: two groups per strategy and mode
    assert len(groups) == len(set(groups)) == 2 * len(STRATEGY_ORDER) * len(CHECKPOINTING) - 1
    assert chosen not in groups
    assert all(r.reason for r in p.rejected)
    too_big = [r for r in p.rejected if not r.fits]
    assert too_big and all(re.search(r"GiB/GPU > 71\.6 GiB usable", r.reason) for r in too_big)


def test_skipped_micro_batches_are_explained():
    # 24 samples over 8 ranks = 3 per rank: micro-batches 1 and 3 divide it, 2 does not
    p = plan(GPT_TINY, topology("h100-sxm-8x"), Goal(global_batch=24))
    assert "micro-batches 2 skipped" in "\n".join(p.reasons)
    assert p.chosen.micro_batch in (1, 3)


def test_bad_requests_raise_plan_errors():
    with pytest.raises(PlanError, match="multiple of 8"):
        plan(GPT_TINY, topology("h100-sxm-8x"), Goal(global_batch=100))
    with pytest.raises(PlanError, match="needs more than one node"):
        plan(GPT_TINY, topology("h100-sxm-8x"), Goal(), overrides=Overrides(strategy="hybrid"))
    with pytest.raises(PlanError, match="pick a divisor of 8"):
        plan(GPT_TINY, topology("h100-sxm-8x"), Goal(global_batch=64),
             overrides=Overrides(micro_batch=3))


def test_overrides_check_themselves_and_list_what_they_force():
    assert Overrides(checkpointing=True).checkpointing == "full"  # an old file's bool
    assert Overrides(tp=2, precision="bf16").forced == (("precision", "bf16"), ("tp", 2))
    assert Overrides().forced == ()
    with pytest.raises(PlanError, match="--micro-batch must be an integer >= 1, got 0"):
        Overrides(micro_batch=0)
    with pytest.raises(DlaunchError, match="unknown strategy 'zero3'"):
        Overrides(strategy="zero3")


def test_a_bf16_reduce_is_priced_on_every_candidate_and_keeps_them_bf16():
    # the plan never chooses the reduce dtype (it changes the sums' rounding); given, every
    # candidate reduces in it, and only bf16 compute can: on this CPU fp32 is weighed otherwise
    cpu = topology("cpu-local")
    given = plan(GPT_TINY, cpu, Goal(global_batch=8), overrides=Overrides(reduce_dtype="bf16"))
    assert {c.strategy.reduce_dtype for c in (given.chosen, *given.rejected)} == {"bf16"}
    assert {c.strategy.precision for c in (given.chosen, *given.rejected)} == {"bf16"}
    default = plan(GPT_TINY, cpu, Goal(global_batch=8))
    assert {c.strategy.reduce_dtype for c in (default.chosen, *default.rejected)} == {"fp32"}
    assert {c.strategy.precision for c in (default.chosen, *default.rejected)} == {"fp32", "bf16"}
    with pytest.raises(PlanError, match="--reduce-dtype bf16 .* --precision fp16"):
        Overrides(reduce_dtype="bf16", precision="fp16")
    with pytest.raises(PlanError, match="unknown --reduce-dtype 'fp8'"):
        Overrides(reduce_dtype="fp8")
    # it forces no candidate (a plan that fits none still says what to change) ...
    assert Overrides(reduce_dtype="bf16").forced == ()
    # ... and, on GPUs, bf16 units (a CPU without them runs bf16 slowly, as --precision bf16 does)
    slow = dataclasses.replace(cpu, accelerator=dataclasses.replace(cpu.accelerator, peak_tflops={"fp32": 0.04}))
    assert plan(GPT_TINY, slow, Goal(global_batch=8), overrides=Overrides(reduce_dtype="bf16")).chosen.strategy \
        .precision == "bf16"
    with pytest.raises(PlanError, match="T4 has no bf16 units"):
        plan(GPT_TINY, topology("t4-4x"), Goal(global_batch=8), overrides=Overrides(reduce_dtype="bf16"))
    # unplanned (a SLURM run without a topology), the precision it needs is its fallback
    from launcher.runspec import LaunchSpec

    spec = LaunchSpec(workload="/w.py", run_id="r", run_dir="/r", reduce_dtype="bf16")
    assert (spec.precision, spec.parallel.reduce_dtype) == ("bf16", "bf16")
    assert LaunchSpec(workload="/w.py", run_id="r", run_dir="/r").precision == "fp32"


def test_overrides_force_fields_and_none_means_unset():
    p = plan(GPT_125M, topology("h100-sxm-8x"), Goal(global_batch=256),
             overrides=Overrides(strategy="fsdp_full", micro_batch=4, compile=True,
                                 checkpointing="selective", precision=None))
    s = p.chosen.strategy
    assert (s.kind, s.checkpointing, s.compile, p.chosen.micro_batch) == \
        ("fsdp_full", "selective", True, 4)
    assert p.chosen.grad_accum == 8


def test_env_follows_the_hardware():
    # the allocator variable under the name the installed torch reads (tests/unit/test_gpu_ready_launch)
    assert plan(GPT_125M, topology("h100-sxm-8x"), Goal(global_batch=256)).env == \
        {alloc_conf_name(installed_torch_version()): "expandable_segments:True"}
    assert plan(GPT_125M, topology("rtx4090-4x"), Goal(global_batch=64)).env[
        "NCCL_P2P_DISABLE"] == "1"
    assert plan(GPT_TINY, topology("cpu-local"), Goal(global_batch=32)).env == \
        {"OMP_NUM_THREADS": "1"}


def test_seq_len_goal_scales_the_profile():
    short = plan(LLAMA3_8B, topology("h100-sxm-8x"), Goal(global_batch=64, seq_len=1024))
    long = plan(LLAMA3_8B, topology("h100-sxm-8x"), Goal(global_batch=64))
    assert short.chosen.time.compute_s < long.chosen.time.compute_s
    assert short.units_per_s > 0


def test_format_plan_shows_breakdown_reasons_and_candidates():
    topo = topology("h100-sxm-8x")
    p = plan(LLAMA3_8B, topo, Goal(global_batch=64))
    text = format_plan(p, LLAMA3_8B, topo)
    for needle in ("Plan for llama3-8b on h100-sxm-8x", "params", "grads", "optimizer",
                   "activations", "overhead", "compute", "exposed communication",
                   "tokens/s", "scaling efficiency", "assumptions", "Why", "DDP does not fit",
                   f"{alloc_conf_name(installed_torch_version())}=expandable_segments:True",
                   "Other candidates"):
        assert needle in text, needle
    assert len(text.splitlines()) >= 8 + len(p.reasons) + len(p.rejected)


def test_plan_is_json_ready():
    # its speed (0.4 ms here) is a benchmark number in docs/benchmarks.md, not a test
    p = plan(LLAMA3_70B, topology("h100-sxm-8x128node-ib"), Goal(global_batch=2048))
    assert json.loads(json.dumps(p.to_dict()))["chosen"]["strategy"]["kind"] == "fsdp_full"


def test_every_shipped_topology_plans_a_small_model():
    names = list_shipped()
    assert len(names) >= 11
    for name in names:
        topo = load_topology(name)
        p = plan(GPT_TINY, topo, Goal())
        assert p.chosen.fits and "fits" in p.reasons[0], name
        assert f"Plan for gpt-tiny on {name}" in format_plan(p, GPT_TINY, topo)


def test_forced_bf16_without_bf16_units_warns():
    p = plan(GPT_125M, topology("v100-sxm-8x"), Goal(global_batch=256),
             overrides=Overrides(precision="bf16"))
    assert p.chosen.strategy.precision == "bf16"
    assert any(r.startswith("warning: V100 SXM2 32GB has no bf16") for r in p.reasons)


def test_seq_len_needs_a_sequence_model():
    images = ModelProfile(name="resnet", num_params=25_000_000, bytes_by_dtype={"float32": 10**8},
                          num_blocks=16, largest_block_params=2_000_000,
                          activation_bytes_per_sample=1e8, block_input_bytes_per_sample=1e6,
                          flops_fwd_per_sample=4e9, sample_units="images")
    assert plan(images, topology("h100-sxm-8x"), Goal(global_batch=256)).chosen.fits
    with pytest.raises(PlanError, match="drop --seq-len"):
        plan(images, topology("h100-sxm-8x"), Goal(global_batch=256, seq_len=1024))


def test_one_device_plans_a_plain_process():
    one = topology("h100-sxm-8x").with_shape(num_nodes=1, devices_per_node=1)
    p = plan(GPT_125M, one, Goal(global_batch=32))
    assert p.chosen.strategy.kind == "ddp" and p.chosen.time.comm_total_s == 0
    assert p.scaling_efficiency == 1.0 and p.reasons[0].startswith("one device: a plain process")

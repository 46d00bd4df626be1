"""The step-time model: the alpha-beta collectives against numbers worked out by hand, and the
physics the GPU compute model must show whatever its fitted constants are.

Every hand-computed value below is written out in the comment next to it, from the formulas in
the module docstrings, not by calling the function under test another way.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from launcher.errors import PlanError, UsageError
from launcher.hardware.types import DeviceSpec, Link, Topology
from launcher.plan import attention, collectives, cost, gemm
from launcher.plan.attention import ATTENTION_CURVES, AttentionCurve, attention_efficiency
from launcher.plan.candidates import profile_for_goal
from launcher.plan.collectives import (
    FSDP_COLLECTIVE_OVERHEAD_S,
    allgather_s,
    hierarchical_allreduce_s,
    reduce_scatter_s,
    ring_allreduce_s,
    tree_allreduce_s,
)
from launcher.plan.cost import (
    LEAF_NODES,
    SCALE_TAX,
    STEP_JITTER,
    attention_flops_fwd,
    compute_s,
    forward_pass,
    gemm_efficiency,
    model_width,
    step_time,
)
from launcher.specs import (
    ATTENTION_KERNELS,
    LOSS_KERNELS,
    NORM_KERNELS,
    Goal,
    ModelProfile,
    Strategy,
)

from tests.helpers import published_runner

GPU = DeviceSpec(name="test-gpu", mem_gib=80, peak_tflops={"fp32": 50, "bf16": 100},
                 compute_capability=(9, 0))
CPU = DeviceSpec(name="test-cpu", mem_gib=8, peak_tflops={"fp32": 0.1, "bf16": 0.2})
BF16 = Strategy(kind="fsdp_full", precision="bf16")
ROOT = Path(__file__).resolve().parents[2]


def link(bw_gb_s: float, latency_us: float = 0.0, kind: str = "nvswitch") -> Link:
    return Link(kind=kind, bw_gb_s=bw_gb_s, latency_us=latency_us)


def topo(nodes: int = 1, per_node: int = 8, intra: Link | None = None,
         inter: Link | None = None, device: DeviceSpec = GPU) -> Topology:
    return Topology(name="t", device="cuda" if device is GPU else "cpu", num_nodes=nodes,
                    devices_per_node=per_node, accelerator=device,
                    intra_node=intra or link(100), inter_node=inter if nodes > 1 else None)


def profile(params: int, *, blocks: int = 10, root: int = 0, flops: float = 1e9) -> ModelProfile:
    """A model with no width information (not a sequence model): matmuls only."""
    return ModelProfile(name="m", num_params=params, bytes_by_dtype={"float32": 4 * params},
                        num_blocks=blocks, largest_block_params=(params - root) // blocks,
                        activation_bytes_per_sample=0, block_input_bytes_per_sample=0,
                        flops_fwd_per_sample=flops)


def transformer(width: int, layers: int = 32, seq: int = 4096, vocab: int = 32000) -> ModelProfile:
    """A Llama-like profile as workloads/gpt.py measures it: 12 d^2 params per block, matmul
    FLOPs 2 x params per token plus SDPA's 4 s^2 d per block, ~90 B of fp32 activations per
    residual element per block, the block input in fp32."""
    block = 12 * width * width
    params = layers * block + 2 * vocab * width
    flops = 2 * params * seq + 4 * seq * seq * width * layers
    return ModelProfile(name=f"d{width}", num_params=params, bytes_by_dtype={"float32": 4 * params},
                        num_blocks=layers, largest_block_params=block,
                        activation_bytes_per_sample=90.0 * seq * width * layers,
                        block_input_bytes_per_sample=4.0 * seq * width,
                        flops_fwd_per_sample=flops, units_per_sample=seq, sample_units="tokens")


# --- alpha-beta collectives ---------------------------------------------------------------------
def test_ring_allreduce_hand_computed():
    # 1 GB over 8 ranks, 100 GB/s, 5 us: 2*7/8 * 1e9/1e11 = 0.0175 s + 2*7*5e-6 = 7e-5 s
    assert ring_allreduce_s(1e9, 8, link(100, 5)) == pytest.approx(0.01757)


def test_allgather_and_reduce_scatter_hand_computed():
    # 1 GB gathered over 4 ranks, 50 GB/s, 10 us: 3/4 * 1e9/5e10 = 0.015 + 3 * 1e-5 = 0.01503
    assert allgather_s(1e9, 4, link(50, 10)) == pytest.approx(0.01503)
    # 2 GB input over 8 ranks, 200 GB/s, 2 us: 7/8 * 2e9/2e11 = 0.00875 + 7 * 2e-6 = 0.008764
    assert reduce_scatter_s(2e9, 8, link(200, 2)) == pytest.approx(0.008764)


def test_hierarchical_allreduce_hand_computed():
    # 1.6 GB, 4 nodes x 8 GPUs; NVLink 400 GB/s 2 us; network 200 GB/s per node, 5 us.
    # intra reduce-scatter: 7/8 * 1.6e9/4e11 = 0.0035 + 7*2e-6            = 0.003514
    # inter all-reduce of 2e8 over 4 nodes, 8 rails share 200 -> 25 GB/s:
    #   2*3/4 * 2e8/2.5e10 = 0.012 + 2*3*5e-6                             = 0.012030
    # intra all-gather: same as the reduce-scatter                         = 0.003514
    got = hierarchical_allreduce_s(1.6e9, 8, 4, link(400, 2), link(200, 5, "infiniband"))
    assert got == pytest.approx(0.019058)


def test_tree_latency_is_logarithmic():
    # 128 nodes, 1 GB, 50 GB/s, 5 us: bandwidth 2*127/128 * 1e9/5e10 = 0.0396875 s either way;
    # ring latency 2*127*5e-6 = 1.27e-3, tree 2*ceil(log2 128)*5e-6 = 7e-5
    ib = link(50, 5, "infiniband")
    assert ring_allreduce_s(1e9, 128, ib) == pytest.approx(0.0396875 + 1.27e-3)
    assert tree_allreduce_s(1e9, 128, ib) == pytest.approx(0.0396875 + 7e-5)


def test_single_rank_and_single_node_cases():
    assert ring_allreduce_s(1e9, 1, link(100)) == 0.0
    assert allgather_s(1e9, 1, link(100)) == 0.0
    assert hierarchical_allreduce_s(1e9, 8, 1, link(100), None) == pytest.approx(0.0175)


@pytest.fixture
def no_fsdp_fixed_cost(monkeypatch):
    """Byte-only FSDP numbers: the per-collective fixed cost is tested on its own."""
    monkeypatch.setattr(collectives, "FSDP_COLLECTIVE_OVERHEAD_S", 0.0)


def test_fsdp_traffic_per_micro_batch(no_fsdp_fixed_cost):
    # 1e9 params in 10 blocks (no root), bf16 gathers, fp32 reduce, 8 ranks at 100 GB/s:
    # all-gather 7/8 * 2e9/1e11 = 0.0175 (forward) + 0.0175 (backward), reduce-scatter
    # 7/8 * 4e9/1e11 = 0.035 -> 0.07 per micro-batch; grad-op skips the backward gather: 0.0525
    p = profile(10**9)
    assert step_time(p, BF16, topo(), 1, 3).comm_total_s == pytest.approx(3 * 0.07)
    grad_op = step_time(p, Strategy(kind="fsdp_grad_op", precision="bf16"), topo(), 1, 3)
    assert grad_op.comm_total_s == pytest.approx(3 * 0.0525)
    fp32 = step_time(p, Strategy(kind="fsdp_full", precision="fp32"), topo(), 1, 1)
    assert fp32.comm_total_s == pytest.approx(0.105)  # gathers move 4 B/param: 0.035 x 3


def test_a_bf16_reduce_halves_the_gradient_bytes(no_fsdp_fixed_cost):
    # test_fsdp_traffic_per_micro_batch's model with reduce_dtype bf16: the reduce-scatter moves
    # 2 B/param, 7/8 * 2e9/1e11 = 0.0175 -> 0.0525 per micro-batch; the gathers are unchanged
    p = profile(10**9)
    bf16 = dataclasses.replace(BF16, reduce_dtype="bf16")
    assert step_time(p, bf16, topo(), 1, 3).comm_total_s == pytest.approx(3 * 0.0525)
    # DDP: its 25 MiB fp32 buckets each all-reduced at half the bytes, 2 x 7/8 x 2e9/1e11 = 0.035
    ddp = Strategy(kind="ddp", precision="bf16")
    fp32_ar = step_time(p, ddp, topo(), 1, 1).comm_total_s
    bf16_ar = step_time(p, dataclasses.replace(ddp, reduce_dtype="bf16"), topo(), 1, 1).comm_total_s
    assert fp32_ar == pytest.approx(0.07) and bf16_ar == pytest.approx(0.035)
    with pytest.raises(UsageError, match="precision` bf16"):
        Strategy(kind="ddp", precision="fp32", reduce_dtype="bf16")
    with pytest.raises(UsageError, match="unknown `reduce_dtype`"):
        Strategy(kind="ddp", precision="bf16", reduce_dtype="fp8")


def test_fsdp_fixed_cost_per_collective():
    # 10 blocks, no root: 10 forward gathers + 10 backward gathers + 10 reduce-scatters per
    # micro-batch = 30 x 50 us = 1.5 ms, which cannot hide
    assert FSDP_COLLECTIVE_OVERHEAD_S == 50e-6
    p = profile(10**6, flops=1e6)
    full = step_time(p, BF16, topo(intra=link(1000)), 1, 2)
    bytes_full = 2 * (7 / 8 * 2e6 / 1e12 * 2 + 7 / 8 * 4e6 / 1e12)
    assert full.comm_total_s == pytest.approx(2 * 1.5e-3 + bytes_full)
    assert full.comm_exposed_s >= 2 * 1.5e-3


def test_multi_node_collectives(no_fsdp_fixed_cost):
    # 2 nodes x 4 GPUs, NVLink 100 GB/s, network 40 GB/s per node, 0 latency, 1e9 params.
    t = topo(nodes=2, per_node=4, intra=link(100), inter=link(40, kind="roce"))
    p = profile(10**9)
    # DDP all-reduce of 4e9 B: flat ring 2*7/8*4e9/4e10 = 0.175; hierarchical: RS 3/4*4e9/1e11
    # = 0.03 + AR of 1e9 over 2 nodes at 10 GB/s = 0.1 + AG 0.03 = 0.16 -> 0.16
    assert step_time(p, Strategy(kind="ddp", precision="bf16"), t, 1, 1).comm_total_s == \
        pytest.approx(0.16)
    # FSDP full, flat rings at 40: AG 0.04375 x 2 + RS 0.0875 = 0.175 per micro-batch
    assert step_time(p, BF16, t, 1, 2).comm_total_s == pytest.approx(2 * 0.175)
    # hybrid: in-node AG 0.015 x 2 + RS 0.03 = 0.06 per micro-batch, once per step the 4 replica
    # all-reduces of 1e9 B share the network: 2*1/2 * 1e9/1e10 = 0.1 -> 0.12 + 0.1
    assert step_time(p, Strategy(kind="hybrid", precision="bf16"), t, 1, 2).comm_total_s == \
        pytest.approx(0.22)


def test_exposed_never_exceeds_total():
    p = profile(10**9, root=2 * 10**8)
    for kind in ("ddp", "fsdp_full", "fsdp_grad_op", "hybrid"):
        for accum in (1, 4):
            t = step_time(p, Strategy(kind=kind, precision="bf16"),
                          topo(nodes=2, per_node=4, inter=link(25, 5, "infiniband")), 2, accum)
            assert 0 < t.comm_exposed_s <= t.comm_total_s + 1e-12


# --- compute -----------------------------------------------------------------------------------
def test_matmul_efficiency_rises_with_gemm_size():
    widths = [512, 1024, 4096, 8192]
    by_width = [gemm_efficiency(GPU, w, 8192) for w in widths]
    assert by_width == sorted(by_width) and by_width[0] < 0.8 * by_width[-1]
    by_tokens = [gemm_efficiency(GPU, 4096, t) for t in (512, 2048, 16384)]
    assert by_tokens == sorted(by_tokens) and by_tokens[0] < 0.8 * by_tokens[-1]
    # the same model spends a larger share of its time per FLOP at one short sequence
    d = transformer(4096, seq=2048)
    per_token = [compute_s(d, BF16, mb, 1, GPU) / mb for mb in (1, 8)]
    assert per_token[0] > 1.05 * per_token[1]


def test_slow_dtypes_saturate_at_smaller_gemms():
    # an H100's shape: fp32 on CUDA cores at 67 of the tensor cores' 989 TFLOP/s
    h100 = DeviceSpec(name="h100", mem_gib=80, peak_tflops={"fp32": 67, "bf16": 989},
                      compute_capability=(9, 0))
    bf16, fp32 = (gemm_efficiency(h100, 768, 32768, p) for p in ("bf16", "fp32"))
    assert bf16 == gemm_efficiency(h100, 768, 32768)  # bf16 as fitted on the published runs
    assert bf16 < 0.6 < 0.75 < fp32 < 0.801
    # a dtype the device does not list runs at its fp32 rate, and saturates like fp32
    assert gemm_efficiency(h100, 768, 32768, "fp16") == fp32


def test_width_and_attention_come_from_the_profile():
    d = transformer(4096, seq=4096)
    assert model_width(d) == 4096
    assert attention_flops_fwd(d) == pytest.approx(4 * 4096**2 * 4096 * 32)
    assert model_width(profile(1000)) is None and attention_flops_fwd(profile(1000)) == 0.0
    # twice the sequence: matmul FLOPs per sample double, attention FLOPs quadruple
    long = profile_for_goal(d, Goal(seq_len=8192))
    matmul = d.flops_fwd_per_sample - attention_flops_fwd(d)
    assert long.flops_fwd_per_sample == pytest.approx(2 * matmul + 4 * attention_flops_fwd(d))
    fwd_short, fwd_long = forward_pass(d, BF16, 1, GPU), forward_pass(long, BF16, 1, GPU)
    # four times the FLOPs, at the kernel's faster rate for the longer sequence: the default
    # kernel's H100 curve (SDPA, measured) runs 465 TFLOP/s at 4k tokens and 534 at 8k
    assert fwd_long.attention_s == pytest.approx(4 * 465 / 534 * fwd_short.attention_s)
    # the measured attention share moves with the sequence too, both ways
    measured = dataclasses.replace(d, attention_flops_fwd_per_sample=0.3 * d.flops_fwd_per_sample)
    for seq, r in ((1024, 0.25), (8192, 2.0)):
        moved = profile_for_goal(measured, Goal(seq_len=seq))
        assert attention_flops_fwd(moved) == pytest.approx(0.3 * d.flops_fwd_per_sample * r * r)
        assert moved.flops_fwd_per_sample == pytest.approx(d.flops_fwd_per_sample * (0.7 * r + 0.3 * r * r))


def test_checkpointing_costs_about_a_third_more_compute():
    d = transformer(8192, layers=8)
    plain = compute_s(d, BF16, 2, 1, GPU)
    full = compute_s(d, Strategy(kind="fsdp_full", precision="bf16",
                                 checkpointing="full"), 2, 1, GPU)
    # a step is forward + backward; full checkpointing adds exactly one more forward
    fwd = forward_pass(d, BF16, 2, GPU)
    assert plain == pytest.approx(fwd.total_s + fwd.backward_s)
    assert full - plain == pytest.approx(fwd.total_s)
    # backward is 2x the forward except attention's, 2.5x its FLOPs at a slower rate, so with
    # attention in the model the extra forward is strictly less than a third of the step
    assert fwd.attention_s > 0 and 2 * fwd.total_s < fwd.backward_s
    assert fwd.attention_bwd_s == pytest.approx(2.5 * 1.1 * fwd.attention_s)  # SDPA: FA2's ratio


def test_no_gpu_step_is_shorter_than_the_host_takes_to_launch_its_ops():
    from launcher.plan.cost import COMPILE_MEMORY_FACTOR, HOST_OP_S
    from launcher.plan.cpu_cost import ADAMW_FIXED_OPS, BACKWARD_OVERHEAD_FACTOR

    one = topo(per_node=1)
    tiny = dataclasses.replace(profile(1000, flops=1e6), forward_ops=200)  # microseconds of GPU work
    t = cost.step_time(tiny, Strategy(kind="ddp", precision="bf16"), one, 1, 2)
    launches = 200 * (1 + BACKWARD_OVERHEAD_FACTOR) * 2 + ADAMW_FIXED_OPS
    assert t.compute_s == pytest.approx(launches * HOST_OP_S)  # ~11 ms: the host's, not the GPU's
    waiting = dict(t.compute_parts)["waiting for launches"]
    assert 0 < waiting < t.compute_s and sum(s for _, s in t.compute_parts) == pytest.approx(t.compute_s)
    compiled = cost.step_time(tiny, Strategy(kind="ddp", precision="bf16", compile=True), one, 1, 2)
    # the model's kernels fused, fewer launches; the optimizer is not compiled
    fused = 200 * (1 + BACKWARD_OVERHEAD_FACTOR) * 2 * COMPILE_MEMORY_FACTOR + ADAMW_FIXED_OPS
    assert compiled.compute_s == pytest.approx(fused * HOST_OP_S)
    graphs = cost.step_time(tiny, Strategy(kind="ddp", precision="bf16", compile=True, compile_mode="reduce-overhead"),
                            one, 1, 2)  # CUDA graphs replay the model's kernels in one launch
    assert graphs.compute_s == pytest.approx(ADAMW_FIXED_OPS * HOST_OP_S)
    # a model whose kernels outlast their launches is priced by its GPU work alone
    big = dataclasses.replace(transformer(4096, layers=4), forward_ops=200)
    assert "waiting for launches" not in dict(cost.step_time(big, BF16, one, 1, 1).compute_parts)
    assert cost.step_time(dataclasses.replace(tiny, forward_ops=0), BF16, one, 1, 1).compute_s < 1e-3  # not profiled
    # a plan set by the launches carries their uncertainty in its interval
    from launcher.plan.search import plan
    from launcher.plan.types import Overrides

    p = plan(tiny, one, Goal(global_batch=2), overrides=Overrides(strategy="ddp", precision="bf16", compile=False))
    assert "waiting for launches" in dict(p.chosen.time.compute_parts)
    assert "the host's launches at 8 us an op" in p.step_interval.basis
    assert p.step_interval.high_s / p.step_interval.low_s > 2.5  # 4-12 us an op at least


def test_compile_only_shortens_the_memory_bound_work():
    d = transformer(2048)
    eager = forward_pass(d, BF16, 2, GPU)
    fused = forward_pass(d, Strategy(kind="fsdp_full", precision="bf16", compile=True), 2, GPU)
    assert fused.gemm_s == eager.gemm_s and fused.attention_s == eager.attention_s
    assert 0 < fused.memory_s < eager.memory_s


# --- communication against compute, and scale ---------------------------------------------------
IB = link(370, 5, "infiniband")


def test_fsdp_communication_grows_with_the_shards():
    d = transformer(4096)
    totals = [step_time(d, BF16, topo(nodes=n, intra=link(370, 3), inter=IB), 2, 1).comm_total_s
              for n in (1, 2, 8, 64)]
    assert totals == sorted(totals) and totals[-1] > totals[0]


def test_per_gpu_throughput_falls_with_world_size_across_ib():
    d = transformer(4096)
    steps = [step_time(d, BF16, topo(nodes=n, intra=link(370, 3), inter=IB), 2, 1).step_time_s
             for n in (1, 4, 16, 64)]
    assert steps == sorted(steps) and steps[-1] > 1.01 * steps[0]
    # the wait for the slowest rank: sqrt(2 ln N) standard deviations of the step, and beyond
    # one tier of leaf switches (LEAF_NODES) SCALE_TAX per doubling of the nodes
    for nodes in (16, 64):
        t = step_time(d, BF16, topo(nodes=nodes, intra=link(370, 3), inter=IB), 2, 1)
        busy = t.compute_s + t.comm_exposed_s + t.contention_s
        spine = SCALE_TAX["cuda"] * max(0.0, math.log2(nodes / LEAF_NODES))
        assert t.sync_wait_s == pytest.approx(
            (STEP_JITTER["cuda"] * math.sqrt(2 * math.log(8 * nodes)) + spine) * busy)
    assert LEAF_NODES == 16  # 16 nodes: no spine tax; 64 nodes: two doublings of it


def test_hidden_communication_still_costs_compute():
    # the same model and traffic: a slower (still hidden) network means more contention
    d = transformer(4096)
    fast = step_time(d, BF16, topo(intra=link(370, 3)), 2, 1)
    slow = step_time(d, BF16, topo(intra=link(120, 3)), 2, 1)
    assert slow.comm_exposed_s < 0.02 * slow.step_time_s  # hidden, all but the first/last
    assert slow.contention_s > fast.contention_s > 0
    assert slow.step_time_s > fast.step_time_s


def test_single_rank_has_no_communication():
    t = step_time(profile(10**9), Strategy(kind="ddp"), topo(per_node=1), 4, 2)
    assert t.comm_total_s == 0 and t.comm_exposed_s == 0 and t.sync_wait_s == 0
    assert t.step_time_s == t.compute_s


# --- attention kernels ---------------------------------------------------------------------------
A100 = DeviceSpec(name="NVIDIA A100-SXM4-80GB", mem_gib=80, peak_tflops={"fp32": 19.5, "bf16": 312},
                  compute_capability=(8, 0))


def test_attention_curves_interpolate_their_sources(monkeypatch):
    monkeypatch.setitem(attention.ATTENTION_RUN_SCALE, "fa2", 1.0)
    # FlashAttention-2 on an A100 (FA2 paper Fig. 4d): 155 TFLOP/s at 2k, 173 at 4k, flat
    # beyond 16k (189), in proportion to s below 512 (99)
    assert attention_efficiency(A100, 2048, "fa2") == pytest.approx(155 / 312)
    assert attention_efficiency(A100, 2896, "fa2") == pytest.approx((155 + 173) / 2 / 312, rel=1e-3)
    assert attention_efficiency(A100, 65536, "fa2") == pytest.approx(189 / 312)
    assert attention_efficiency(A100, 256, "fa2") == pytest.approx(99 / 2 / 312)
    # other architectures take the H100 curve, as a fraction of their own peak
    l40s = dataclasses.replace(A100, compute_capability=(8, 9))
    assert attention_efficiency(l40s, 8192, "fa2") == pytest.approx(308 / 989)
    # every curve rises (or holds) with the sequence; Triton's sits below FA2's on an A100
    for kernel, curves in ATTENTION_CURVES.items():
        for arch, curve in curves.items():
            assert list(curve.tflops) == sorted(curve.tflops) or kernel == "triton-fa", (kernel, arch)
            assert curve.source
    for s in (512, 2048, 16384):
        assert ATTENTION_CURVES["triton-fa"][(8, 0)].fraction(s) < ATTENTION_CURVES["fa2"][(8, 0)].fraction(s)
    with pytest.raises(PlanError, match="attention curve"):
        AttentionCurve(tflops=(1.0,), peak_tflops=1.0, source="x")


def test_attention_time_follows_the_run_kernel():
    d = transformer(4096, seq=16384)
    fa2 = forward_pass(d, BF16, 1, A100)  # the default kernel on an A100: SDPA = FA2's curve
    triton = forward_pass(dataclasses.replace(d, attention_kernel="triton-fa"), BF16, 1, A100)
    # at 16k tokens: FA2 189 TFLOP/s (x its run scale), Triton 80 (x its own) forward+backward;
    # matmuls unchanged
    expected = (189 * attention.ATTENTION_RUN_SCALE["sdpa"]) / (80 * attention.ATTENTION_RUN_SCALE["triton-fa"])
    both = [p.attention_s + p.attention_bwd_s for p in (triton, fa2)]
    assert both[0] / both[1] == pytest.approx(expected)
    assert triton.gemm_s == fa2.gemm_s and triton.memory_s == fa2.memory_s
    # the forward+backward seconds split by the kernels' own rates: backward does 2.5x the
    # forward's FLOPs; Triton's forward runs 1.7x its backward's rate, FA2's 1.1x
    for p, r in ((triton, 1.7), (fa2, 1.1)):
        assert p.attention_bwd_s / p.attention_s == pytest.approx(2.5 * r)


def test_full_checkpointing_recomputes_attention_at_the_forward_rate():
    d = dataclasses.replace(transformer(4096, seq=32768), attention_kernel="triton-fa")
    full = dataclasses.replace(BF16, checkpointing="full")
    plain, again = (compute_s(d, s, 1, 1, A100) for s in (BF16, full))
    fwd = forward_pass(d, BF16, 1, A100)
    # a whole-block checkpoint runs the forward once more; attention's part at the forward's
    # rate, 1 / (1 + 2.5 x 1.7) = 0.19 of its forward+backward seconds, not 1 / 3.5 = 0.29
    attention_both = fwd.attention_s + fwd.attention_bwd_s
    assert again - plain == pytest.approx(fwd.gemm_s + fwd.memory_s + attention_both / (1 + 2.5 * 1.7))
    assert plain == pytest.approx(3 * (fwd.gemm_s + fwd.memory_s) + attention_both)
    # the step's parts by kind of work add up to its compute, the optimizer's step included, and
    # each kind is recomputed as its mode says (selective: no attention, all memory-bound work)
    t = step_time(d, full, topo(per_node=1, device=A100), 1, 2)
    assert sum(s for _, s in t.compute_parts) == pytest.approx(t.compute_s)
    assert dict(t.compute_parts)["attention"] == pytest.approx(2 * (attention_both + fwd.attention_s))
    sel = step_time(d, dataclasses.replace(BF16, checkpointing="selective"), topo(per_node=1, device=A100), 1, 3)
    assert sum(s for _, s in sel.compute_parts) == pytest.approx(sel.compute_s)
    assert dict(sel.compute_parts)["attention"] == pytest.approx(3 * attention_both)
    assert dict(sel.compute_parts)["memory-bound"] == pytest.approx(3 * 4 * fwd.memory_s)


def test_run_kernels_are_validated_profile_inputs_with_defaults():
    d = transformer(1024, seq=1024)
    # what the workloads call
    assert (d.attention_kernel, d.loss_kernel, d.norm_kernel) == ("sdpa", "eager", "eager")
    for bad in ({"attention_kernel": "xformers"}, {"loss_kernel": "liger"},
                {"norm_kernel": "apex"}):
        with pytest.raises(PlanError, match="kernel"):
            dataclasses.replace(d, **bad)
    # every attention kernel a profile may name has a curve
    assert set(ATTENTION_KERNELS) == set(ATTENTION_CURVES) | {"eager"}  # written out: matmuls, no curve
    # a profile cached before the fields existed loads with the defaults
    from launcher.plan.resolve import _profile_from_json
    old = {k: v for k, v in dataclasses.asdict(d).items()
           if k not in ("attention_kernel", "loss_kernel", "norm_kernel")}
    assert _profile_from_json(old) == d


def test_fused_loss_prices_the_logits_by_its_own_passes():
    # 768 wide, 12 blocks, vocab 50368 at 1k tokens (MPT-125M): backward's transient is two
    # fp32 logits tensors; the eager loss's log_softmax output is among the saved bytes
    seq, vocab = 1024, 50368
    d = dataclasses.replace(transformer(768, layers=12, seq=seq, vocab=vocab),
                            backward_transient_bytes_per_sample=2 * 4.0 * seq * vocab)
    assert cost.logits_bytes(d) == 4.0 * seq * vocab
    eager = forward_pass(d, BF16, 2, A100)
    fused = forward_pass(dataclasses.replace(d, loss_kernel="fused"), BF16, 2, A100)
    # the logits leave MEMORY_PASSES' traffic and come back at FUSED_LOSS_PASSES, in bf16
    saved_by = ((cost.MEMORY_PASSES - cost.FUSED_LOSS_PASSES) * 2 * 2.0 * seq * vocab
                / cost.hbm_bytes_per_s(A100))
    assert eager.memory_s - fused.memory_s == pytest.approx(saved_by)
    assert fused.gemm_s == eager.gemm_s and fused.attention_s == eager.attention_s
    # not a language model: nothing to take out
    assert cost.logits_bytes(dataclasses.replace(d, sample_units="samples")) == 0.0


def test_low_precision_norms_skip_autocasts_fp32_round_trips():
    seq, width, layers = 1024, 768, 12
    d = transformer(width, layers=layers, seq=seq)
    eager = forward_pass(d, BF16, 2, A100)
    low = forward_pass(dataclasses.replace(d, norm_kernel="low-precision"), BF16, 2, A100)
    # two norms a block and the final one, 16 B an element fewer each (20 B in fp32, 4 in bf16)
    norms = (2 * layers + 1) * width * seq * 2
    assert eager.memory_s - low.memory_s == pytest.approx(
        cost.NORM_AUTOCAST_BYTES * norms / cost.hbm_bytes_per_s(A100))
    # fp32 casts nothing: the same either way
    fp32 = Strategy(kind="fsdp_full", precision="fp32")
    assert (forward_pass(dataclasses.replace(d, norm_kernel="low-precision"), fp32, 2, A100).memory_s
            == forward_pass(d, fp32, 2, A100).memory_s)


def test_the_lm_head_is_priced_as_a_wide_gemm():
    seq, vocab = 1024, 50368
    d = dataclasses.replace(transformer(768, layers=12, seq=seq, vocab=vocab),
                            backward_transient_bytes_per_sample=2 * 4.0 * seq * vocab)
    head = cost.head_flops_fwd(d)
    assert head == pytest.approx(2 * 768 * vocab * seq)
    tokens = 2 * seq
    peak = cost.peak_flops(A100, "bf16")
    blocks = d.flops_fwd_per_sample - cost.attention_flops_fwd(d) - head
    expected = 2 * (blocks / cost.gemm_efficiency(A100, 768, tokens)
                    + head / cost.gemm_efficiency(A100, math.inf, tokens)) / peak
    assert forward_pass(d, BF16, 2, A100).gemm_s == pytest.approx(expected)
    # the head keeps the tokens' factor but not the width's
    assert cost.gemm_efficiency(A100, math.inf, tokens) == pytest.approx(
        gemm.GEMM_PEAK_FRACTION[(8, 0)] * tokens / (tokens + gemm.GEMM_HALF_TOKENS))
    # without a measured transient (no logits known) every matmul is priced at the width
    assert cost.head_flops_fwd(transformer(768, layers=12, seq=seq)) == 0.0


# --- the published-results benchmark's data -----------------------------------------------------
def test_published_rows_load_and_every_row_is_sourced():
    run = published_runner()
    rows = run.load_rows()
    assert len(rows) >= 40
    assert len({r["id"] for r in rows}) == len(rows)
    for row in rows:
        assert row["source"]["url"].startswith("https://") and row["source"]["where"], row["id"]
        assert row["tokens_per_s_per_gpu"] > 0 and row["gpus"] % row["nodes"] == 0, row["id"]
        # every row maps onto a shipped topology and workload options
        assert (ROOT / "topologies" / f"{run.topology_name(row)}.yaml").is_file(), row["id"]
        assert run.workload_args(row)[:2] in (["--size", "mpt-7b"], ["--size", "llama2-7b"])
        assert row["split"] in ("fit", "check") and row["attention_kernel"] in ATTENTION_KERNELS
        assert row["loss_kernel"] in LOSS_KERNELS and row["norm_kernel"] in NORM_KERNELS
    # the check rows (no constant is fitted on them) cover short and long sequences
    check = {r["seq_len"] for r in rows if r["split"] == "check"}
    assert {512, 1024, 16384, 32768, 65536} <= check


def test_published_bands_by_model_and_job_size_split_where_the_issue_draws_them():
    run = published_runner()
    assert [run.size_band({"params_b": b}) for b in (0.125, 0.99, 1.0, 10.0, 10.1, 530)] == [
        "<1B", "<1B", "1-10B", "1-10B", ">10B", ">10B"]
    assert [run.gpu_band({"gpus": g}) for g in (8, 64, 65, 2240)] == ["<=64", "<=64", ">64", ">64"]
    # every row falls in a band of each kind, and each band holds rows
    rows = run.load_rows()
    assert {run.size_band(r) for r in rows} == set(run.SIZE_BANDS)
    assert {run.gpu_band(r) for r in rows} == set(run.GPU_BANDS)


def test_published_loader_rejects_an_unsourced_row(tmp_path):
    run = published_runner()
    text = (ROOT / "benchmarks" / "published" / "results.yaml").read_text(encoding="utf-8")
    bad = tmp_path / "results.yaml"
    bad.write_text(text.replace("    where: ", "    wher: ", 1), encoding="utf-8")
    with pytest.raises(ValueError, match="source.url/where"):
        run.load_rows(bad)


def test_published_megatron_zero3_rows_agree_with_their_papers_training_time():
    # Megatron-LM (arXiv 2104.04473) Table 2 gives TFLOP/s per GPU; the rows convert them to
    # tokens/s/GPU by the paper's own FLOPs per token, and the table's "training time for 300B
    # tokens (days)" column must follow from the converted rate, within the table's rounding
    # (whole days, whole TFLOP/s) and the row's (0.1 tokens/s)
    rows = [r for r in published_runner().load_rows() if r["id"].startswith("megatron-zero3-")]
    assert len(rows) == 6 and all(r["split"] == "check" for r in rows)
    for r in rows:
        tflops = float(r["derived"].split("= ", 1)[1].split(" TFLOP/s", 1)[0])
        stated = float(r["derived"].rsplit("Table 2 says ", 1)[1])
        tokens = r["tokens_per_s_per_gpu"]
        days = 300e9 / (tokens * r["gpus"]) / 86400
        assert abs(days - stated) <= 0.5 + days * (0.5 / tflops + 0.05 / tokens), r["id"]
        assert r["global_batch"] == r["micro_batch"] * r["grad_accum"] * r["gpus"], r["id"]


# --- FSDP's collectives as FSDP2 runs them (two gloo ranks) ----------------------------------------
GATHER_CASES = [(ckpt, unit) for ckpt in ("none", "full") for unit in ("block", "linear")]


def _count_gathers(rank: int, init: str, out) -> None:  # type: ignore[no-untyped-def]
    """One forward and backward of gpt tiny per case through runtime.wrap, counting FSDP2's all-gathers."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import default_collate

    from launcher.runtime.context import RankContext
    from launcher.runtime.wrap import wrap
    from launcher.workload import load_workload

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
        ctx = RankContext(rank=rank, local_rank=rank, world_size=2, local_world_size=2, node_rank=0, host="h",
                          device_type="cpu")
        workload = load_workload(str(Path(__file__).parents[2] / "workloads" / "gpt.py"), ["--size", "tiny"])
        calls: list[bool] = []
        gather = dist.all_gather_single

        def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls.append(torch.is_grad_enabled())  # FSDP2 gathers for backward under no_grad
            return gather(*args, **kwargs)

        dist.all_gather_single = counted  # type: ignore[assignment]
        batch = default_collate(workload.first_samples(2))
        for ckpt, unit in GATHER_CASES:
            model = workload.build_model()
            wrapped = wrap(model, Strategy(kind="fsdp_full", checkpointing=ckpt, fsdp_unit=unit), ctx,
                           workload.blocks(model))
            calls.clear()
            loss = workload.loss_fn(wrapped.module, batch)
            forward = len(calls)
            loss.backward()
            out.put((ckpt, unit, rank, forward, len(calls) - forward))
    except BaseException:
        import traceback

        out.put(("error", traceback.format_exc(), rank, 0, 0))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.distributed
def test_fsdp2_gathers_each_unit_once_a_pass_as_the_model_prices_it(tmp_path):
    """fsdp_traffic's count: forward gathers every unit, backward every block's unit again, the
    root excepted (it keeps its parameters: runtime.wrap); a recompute gathers nothing more, even
    with linear units inside the checkpointed block (FSDP2's hooks keep what backward gathered)."""
    import multiprocessing

    import torch

    from launcher.plan.memory import units_per_block
    from launcher.plan.profile import linear_units
    from launcher.workload import load_workload

    workload = load_workload(str(Path(__file__).parents[2] / "workloads" / "gpt.py"), ["--size", "tiny"])
    with torch.device("meta"):
        model = workload.build_model()
    blocks = workload.blocks(model)
    largest, per_block = linear_units(blocks)
    profile = ModelProfile(name="gpt-tiny", num_params=sum(p.numel() for p in model.parameters()),
                           bytes_by_dtype={}, num_blocks=len(blocks), activation_bytes_per_sample=1.0,
                           block_input_bytes_per_sample=1.0, flops_fwd_per_sample=1.0,
                           largest_block_params=max(sum(p.numel() for p in b.parameters()) for b in blocks),
                           linear_unit_params=largest, linear_units_per_block=per_block)
    mp = multiprocessing.get_context("spawn")
    out = mp.Queue()
    procs = [mp.Process(target=_count_gathers, args=(r, f"file://{tmp_path / 'store'}", out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        seen = [out.get(timeout=120) for _ in range(2 * len(GATHER_CASES))]
    finally:
        for p in procs:
            p.join(timeout=30)
    assert not [s for s in seen if s[0] == "error"], seen
    for ckpt, unit, _rank, forward, backward in seen:
        strategy = Strategy(kind="fsdp_full", checkpointing=ckpt, fsdp_unit=unit)
        units = collectives.fsdp_units(profile, strategy)
        assert (forward, backward) == (units, len(blocks) * units_per_block(profile, strategy)), (ckpt, unit)
    assert {(s[1], s[3]) for s in seen} == {("block", 5), ("linear", 33)}  # gpt tiny: 4 blocks of 7 linears + rest

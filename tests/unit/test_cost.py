"""The alpha-beta communication model and the compute model, against numbers worked out by hand.

Every expected value below was computed on paper from the formulas in design.md (written out in
the comment next to it), not by calling the function under test another way.
"""

from __future__ import annotations

import pytest

from launcher.plan import cost
from launcher.plan.cost import (
    ACHIEVABLE_FRACTION_CUDA,
    FSDP_COLLECTIVE_OVERHEAD_S,
    OVERLAP_EFFICIENCY,
    allgather_s,
    compute_s,
    hierarchical_allreduce_s,
    reduce_scatter_s,
    ring_allreduce_s,
    step_time,
    tree_allreduce_s,
)
from launcher.specs import DeviceSpec, Link, ModelProfile, Strategy, Topology

GPU = DeviceSpec(name="test-gpu", mem_gib=80, peak_tflops={"fp32": 50, "bf16": 100},
                 compute_capability=(9, 0))


def link(bw_gb_s: float, latency_us: float = 0.0, kind: str = "nvswitch") -> Link:
    return Link(kind=kind, bw_gb_s=bw_gb_s, latency_us=latency_us)


def topo(nodes: int = 1, per_node: int = 8, intra: Link | None = None,
         inter: Link | None = None) -> Topology:
    return Topology(name="t", device="cuda", num_nodes=nodes, devices_per_node=per_node,
                    accelerator=GPU, intra_node=intra or link(100),
                    inter_node=inter if nodes > 1 else None)


def profile(params: int, *, blocks: int = 10, root: int = 0, flops: float = 1e9) -> ModelProfile:
    return ModelProfile(name="m", num_params=params, bytes_by_dtype={"float32": 4 * params},
                        num_blocks=blocks, largest_block_params=(params - root) // blocks,
                        activation_bytes_per_sample=0, block_input_bytes_per_sample=0,
                        flops_fwd_per_sample=flops)


def test_ring_allreduce_hand_computed():
    # 1 GB over 8 ranks, 100 GB/s, 5 us: 2*7/8 * 1e9/1e11 = 0.0175 s + 2*7*5e-6 = 7e-5 s
    assert ring_allreduce_s(1e9, 8, link(100, 5)) == pytest.approx(0.01757)


def test_allgather_hand_computed():
    # 1 GB gathered over 4 ranks, 50 GB/s, 10 us: 3/4 * 1e9/5e10 = 0.015 + 3 * 1e-5 = 0.01503
    assert allgather_s(1e9, 4, link(50, 10)) == pytest.approx(0.01503)


def test_reduce_scatter_hand_computed():
    # 2 GB input over 8 ranks, 200 GB/s, 2 us: 7/8 * 2e9/2e11 = 0.00875 + 7 * 2e-6 = 0.008764
    assert reduce_scatter_s(2e9, 8, link(200, 2)) == pytest.approx(0.008764)


def test_hierarchical_allreduce_hand_computed():
    # 1.6 GB, 4 nodes x 8 GPUs; NVLink 400 GB/s 2 us; network 200 GB/s per node, 5 us.
    # intra reduce-scatter: 7/8 * 1.6e9/4e11 = 0.0035 + 7*2e-6            = 0.003514
    # inter all-reduce of 1.6e9/8 = 2e8 over 4 nodes, 8 rails share 200 -> 25 GB/s:
    #   2*3/4 * 2e8/2.5e10 = 0.012 + 2*3*5e-6                             = 0.012030
    # intra all-gather: same as the reduce-scatter                         = 0.003514
    got = hierarchical_allreduce_s(1.6e9, 8, 4, link(400, 2), link(200, 5, "infiniband"))
    assert got == pytest.approx(0.019058)


def test_tree_latency_is_logarithmic():
    # 128 nodes, 1 GB, 50 GB/s, 5 us: bandwidth 2*127/128 * 1e9/5e10 = 0.0396875 s either way;
    # ring latency 2*127*5e-6 = 1.27e-3, tree 2*ceil(log2 128)*5e-6 = 2*7*5e-6 = 7e-5
    ib = link(50, 5, "infiniband")
    assert ring_allreduce_s(1e9, 128, ib) == pytest.approx(0.0396875 + 1.27e-3)
    assert tree_allreduce_s(1e9, 128, ib) == pytest.approx(0.0396875 + 7e-5)


def test_single_rank_and_single_node_cases():
    assert ring_allreduce_s(1e9, 1, link(100)) == 0.0
    assert allgather_s(1e9, 1, link(100)) == 0.0
    # one node: hierarchical is the plain ring (2*7/8 * 1e9/1e11 = 0.0175)
    assert hierarchical_allreduce_s(1e9, 8, 1, link(100), None) == pytest.approx(0.0175)


def test_compute_hand_computed():
    # 1 TFLOP forward per sample, 8 samples per step, bf16 peak 100 TFLOP/s:
    # 3 * 1e12 * 8 / (1e14 * 0.4) = 0.6 s; with checkpointing x 4/3 = 0.8 s
    p = profile(1000, flops=1e12)
    assert ACHIEVABLE_FRACTION_CUDA == 0.4
    assert compute_s(p, Strategy(precision="bf16"), 4, 2, GPU) == pytest.approx(0.6)
    ckpt = Strategy(precision="bf16", activation_checkpointing=True)
    assert compute_s(p, ckpt, 4, 2, GPU) == pytest.approx(0.8)
    # fp32 runs at the fp32 peak (TF32 is off by default in PyTorch): 3e12*8/(5e13*0.4) = 1.2
    assert compute_s(p, Strategy(precision="fp32"), 4, 2, GPU) == pytest.approx(1.2)


def test_ddp_one_bucket_is_fully_exposed():
    # 6,553,600 params -> 26,214,400 B of fp32 grads = exactly one 25 MiB bucket; nothing can
    # hide the last bucket: 2*7/8 * 26,214,400 / 1e11 = 4.58752e-4 s
    t = step_time(profile(6_553_600), Strategy(kind="ddp", precision="bf16"), topo(), 1, 1)
    assert t.comm_total_s == pytest.approx(4.58752e-4)
    assert t.comm_exposed_s == pytest.approx(4.58752e-4)


def test_ddp_overlaps_with_last_backward_only():
    # 4 buckets: 4 * 4.58752e-4 = 1.835008e-3 s of all-reduce.
    # one micro-batch: 3 * 1e9 / (1e14 * 0.4) = 7.5e-5 s; backward 2/3 of it, 80% hideable:
    # 7.5e-5 * 2/3 * 0.8 = 4e-5 -> exposed 1.835008e-3 - 4e-5 = 1.795008e-3
    assert OVERLAP_EFFICIENCY["cuda"] == 0.8
    p = profile(4 * 6_553_600)
    s = Strategy(kind="ddp", precision="bf16")
    one = step_time(p, s, topo(), 1, 1)
    assert one.comm_total_s == pytest.approx(1.835008e-3)
    assert one.comm_exposed_s == pytest.approx(1.795008e-3)
    # accumulation (no_sync): 4x the compute, the same single all-reduce
    four = step_time(p, s, topo(), 1, 4)
    assert four.compute_s == pytest.approx(4 * 7.5e-5)
    assert four.comm_total_s == pytest.approx(one.comm_total_s)
    assert four.comm_exposed_s == pytest.approx(one.comm_exposed_s)


@pytest.fixture
def no_fsdp_fixed_cost(monkeypatch):
    """Byte-only FSDP numbers: the per-collective fixed cost is tested on its own."""
    monkeypatch.setitem(cost.FSDP_COLLECTIVE_OVERHEAD_S, "cuda", 0.0)


def test_fsdp_traffic_per_micro_batch(no_fsdp_fixed_cost):
    # 1e9 params in 10 blocks (no root), bf16 gathers, fp32 reduce, 8 ranks at 100 GB/s, 0 latency:
    # all-gather 7/8 * 2e9/1e11 = 0.0175 (forward) + 0.0175 (backward), reduce-scatter
    # 7/8 * 4e9/1e11 = 0.035 -> 0.07 per micro-batch; grad-op skips the backward gather: 0.0525
    p = profile(10**9)
    full = step_time(p, Strategy(kind="fsdp_full", precision="bf16"), topo(), 1, 3)
    assert full.comm_total_s == pytest.approx(3 * 0.07)
    grad_op = step_time(p, Strategy(kind="fsdp_grad_op", precision="bf16"), topo(), 1, 3)
    assert grad_op.comm_total_s == pytest.approx(3 * 0.0525)
    # fp32: gathers move 4 B/param: 0.035 + 0.035 + 0.035 = 1.5x the bf16 gathers' 0.07
    fp32 = step_time(p, Strategy(kind="fsdp_full", precision="fp32"), topo(), 1, 1)
    assert fp32.comm_total_s == pytest.approx(0.105)


def test_fsdp_fixed_cost_per_collective():
    # 10 blocks, no root: full shard issues 10 forward gathers + 10 backward gathers + 10
    # reduce-scatters per micro-batch = 30 x 50 us = 1.5 ms; grad-op 20 x 50 us = 1 ms.
    # 1e6 params on 1 TB/s with no latency: bytes cost ~nothing, so the fixed cost dominates.
    assert FSDP_COLLECTIVE_OVERHEAD_S["cuda"] == 50e-6
    t = topo(intra=link(1000))
    p = profile(10**6, flops=1e6)
    full = step_time(p, Strategy(kind="fsdp_full", precision="bf16"), t, 1, 2)
    grad_op = step_time(p, Strategy(kind="fsdp_grad_op", precision="bf16"), t, 1, 2)
    bytes_full = 2 * (7 / 8 * 2e6 / 1e12 * 2 + 7 / 8 * 4e6 / 1e12)
    assert full.comm_total_s == pytest.approx(2 * 1.5e-3 + bytes_full)
    assert full.comm_exposed_s >= 2 * 1.5e-3
    assert grad_op.comm_total_s == pytest.approx(2 * 1e-3 + 2 * 7 / 8 * 6e6 / 1e12)


def test_multi_node_collectives(no_fsdp_fixed_cost):
    # 2 nodes x 4 GPUs, NVLink 100 GB/s, network 40 GB/s per node, 0 latency, 1e9 params.
    t = topo(nodes=2, per_node=4, intra=link(100), inter=link(40, kind="roce"))
    p = profile(10**9)
    # DDP all-reduce of 4e9 B: flat ring over 8 at 40: 2*7/8*4e9/4e10 = 0.175;
    # hierarchical: RS 3/4*4e9/1e11 = 0.03 + AR of 1e9 over 2 nodes at 40/4 = 10 GB/s:
    # 2*1/2*1e9/1e10 = 0.1 + AG 0.03 = 0.16 -> the faster, 0.16
    assert step_time(p, Strategy(kind="ddp", precision="bf16"), t, 1, 1).comm_total_s == \
        pytest.approx(0.16)
    # FSDP full: flat rings over all 8 ranks at the slowest link (40):
    # AG 7/8*2e9/4e10 = 0.04375 (x2) + RS 7/8*4e9/4e10 = 0.0875 -> 0.175 per micro-batch
    assert step_time(p, Strategy(kind="fsdp_full", precision="bf16"), t, 1, 2).comm_total_s == \
        pytest.approx(2 * 0.175)
    # hybrid: inside a node AG 3/4*2e9/1e11 = 0.015 (x2) + RS 3/4*4e9/1e11 = 0.03 -> 0.06 per
    # micro-batch; once per step the 4 replica all-reduces of 4e9/4 = 1e9 B share the network:
    # 2*1/2 * 1e9/(4e10/4) = 0.1.  Two micro-batches: 0.12 + 0.1 = 0.22
    assert step_time(p, Strategy(kind="hybrid", precision="bf16"), t, 1, 2).comm_total_s == \
        pytest.approx(0.22)


def test_single_rank_has_no_communication():
    t = step_time(profile(10**9), Strategy(kind="ddp"), topo(per_node=1), 4, 2)
    assert t.comm_total_s == 0 and t.comm_exposed_s == 0
    assert t.step_time_s == t.compute_s


def test_exposed_never_exceeds_total():
    p = profile(10**9, root=2 * 10**8)
    for kind in ("ddp", "fsdp_full", "fsdp_grad_op", "hybrid"):
        for accum in (1, 4):
            t = step_time(p, Strategy(kind=kind, precision="bf16"),
                          topo(nodes=2, per_node=4, inter=link(25, 5, "infiniband")), 2, accum)
            assert 0 < t.comm_exposed_s <= t.comm_total_s + 1e-12

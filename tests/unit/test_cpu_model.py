"""The CPU model's measured anchors: the workload's own timed steps (step_probe), gloo's cost
between busy ranks (gloo_probe), and what the model makes of them (cpu_cost, cpu_comm)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from launcher.hardware.types import Link, Topology
from launcher.plan import step_probe
from launcher.plan.candidates import precisions_for
from launcher.plan.collectives import fsdp_units
from launcher.plan.cost import step_time
from launcher.plan.cpu_comm import DDP_BUCKET_OPS, cpu_ddp_comm, cpu_sharded_comm, ddp_buckets
from launcher.plan.cpu_rates import CpuRates, GlooRates, ProbedCpu
from launcher.plan.gloo_probe import measure_gloo
from launcher.plan.profile import profile_workload
from launcher.plan.resolve import _probe_sizes, cached_gloo_rates, cached_step_timing, resolve_topology
from launcher.plan.step_probe import PassTimes, StepTiming, WorkloadTiming, measure_steps
from launcher.plan.types import Overrides
from launcher.specs import ModelProfile, Strategy
from launcher.workload import load_workload

from tests.helpers import WORKLOADS

RATES = CpuRates(gemm_gflops={"fp32": 100.0, "bf16": 200.0}, half_rows={"fp32": 4.0, "bf16": 8.0},
                 mem_gb_s=20.0, cache_gb_s=60.0, cast_gb_s=30.0, llc_bytes=32 * 2**20, cores=2)
GLOO2 = GlooRates(ranks=2, latency_s={"ar": 1e-3, "ag": 1e-3, "rs": 1e-3},
                  s_per_byte={"ar": 1e-9, "ag": 1e-9, "rs": 2e-9})


def topology(ranks: int, gloo: GlooRates | None = None, cores: int = 2) -> Topology:
    dev = ProbedCpu(name="probed", mem_gib=8, peak_tflops={"fp32": 0.1, "bf16": 0.2}, rates=RATES,
                    gloo=gloo)
    return Topology(name="cpu", device="cpu", num_nodes=1, devices_per_node=ranks, accelerator=dev,
                    cpu_cores_per_node=cores, intra_node=Link(kind="shm", bw_gb_s=1.0, latency_us=100))


PROFILE = ModelProfile(name="m", num_params=1_000_000, bytes_by_dtype={"float32": 4_000_000},
                       num_blocks=4, largest_block_params=200_000, activation_bytes_per_sample=1e5,
                       block_input_bytes_per_sample=1e3, flops_fwd_per_sample=2e6, forward_ops=40,
                       param_tensors=8)


def timing(threads: int = 1) -> WorkloadTiming:
    """A fixed cost of 2 ms per micro-batch (forward 1, backward 1) plus 1 ms per sample."""
    passes = (PassTimes(micro_batch=1, data_s=0.0, forward_s=0.0015, backward_s=0.0025),
              PassTimes(micro_batch=8, data_s=0.0, forward_s=0.005, backward_s=0.009))
    return WorkloadTiming(threads=threads, units_per_sample=1, load_average=0.1,
                          precisions={"fp32": StepTiming(precision="fp32", passes=passes,
                                                         optimizer_s=0.004)})


# --- the step probe ------------------------------------------------------------------------------
def test_measured_passes_are_a_fixed_cost_plus_a_cost_per_sample():
    t = timing().precisions["fp32"]
    assert t.at(1).forward_s == pytest.approx(0.0015) and t.at(8).backward_s == pytest.approx(0.009)
    mid = t.at(4)  # interpolated: 1 ms + 0.5 ms x 4 forward, 2 ms + 1 ms x ... backward
    assert mid.forward_s == pytest.approx(0.0015 + 3 * 0.0035 / 7)
    assert t.at(16).forward_s == pytest.approx(0.0015 + 15 * 0.0035 / 7)  # extrapolated
    one = StepTiming(precision="fp32", passes=t.passes[:1], optimizer_s=0.0)
    assert one.at(4).forward_s == pytest.approx(4 * 0.0015)  # one size only: proportional


def test_a_part_the_larger_size_timed_faster_grows_past_it_instead_of_falling_to_zero():
    # timer noise over a cost per sample too small to resolve (a busy host timed micro-batch 1)
    noisy = StepTiming(precision="fp32", optimizer_s=0.002, passes=(
        PassTimes(micro_batch=1, data_s=0.0004, forward_s=0.002, backward_s=0.001),
        PassTimes(micro_batch=16, data_s=0.0003, forward_s=0.0013, backward_s=0.0019)))
    assert noisy.at(8).forward_s == pytest.approx(0.002 - 7 * 0.0007 / 15)  # between: the line
    far = noisy.at(512)
    assert far.forward_s == pytest.approx(0.0013 * 32) and far.data_s == pytest.approx(0.0003 * 32)
    assert far.backward_s == pytest.approx(0.001 + 511 * 0.0009 / 15)  # a rising part keeps its line


def test_fsdp_with_low_precision_is_timed_with_its_batch_norms_in_fp32():
    import torch

    # the switch: batch norms see fp32 inputs and hand bf16 back only while it is on
    seen: list[torch.dtype] = []
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    switch = step_probe.fp32_norm_switch(torch, model)
    model[1].register_forward_pre_hook(lambda _m, args: seen.append(args[0].dtype))
    x = torch.randn(2, 3, 8, 8)
    for on in (False, True):
        switch[0] = on
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        assert out.dtype == torch.bfloat16
    assert seen == [torch.bfloat16, torch.float32]
    # which timing a strategy reads: FSDP under bf16 with batch norms, the fp32-norm one
    key = step_probe.timing_key
    assert key("bf16", "fsdp_full", 15) == "bf16" + step_probe.FP32_NORMS
    assert key("bf16", "ddp", 15) == key("bf16", "fsdp_full", 0) == "bf16"
    assert key("fp32", "fsdp_full", 15) == "fp32"
    # and the probe takes exactly the timings those keys name
    assert step_probe.probe_precisions(("fp32", "bf16"), 15) == ("fp32", "bf16", key("bf16", "fsdp_full", 15))
    assert step_probe.probe_precisions(("fp32", "bf16"), 0) == ("fp32", "bf16")
    passes = lambda f: (PassTimes(micro_batch=1, data_s=0.0, forward_s=f, backward_s=2 * f),)  # noqa: E731
    timings = WorkloadTiming(threads=1, units_per_sample=1, load_average=0.0, precisions={
        "bf16": StepTiming(precision="bf16", passes=passes(0.01), optimizer_s=0.0),
        key("bf16", "fsdp_full", 1): StepTiming(precision="bf16", passes=passes(0.02), optimizer_s=0.0)})
    norms = dataclasses.replace(PROFILE, batch_norms=2)
    fsdp, ddp = Strategy(kind="fsdp_full", precision="bf16"), Strategy(kind="ddp", precision="bf16")
    parts = lambda p, s: dict(step_time(p, s, topology(1), 1, 1, timing=timings).compute_parts)  # noqa: E731
    assert parts(norms, fsdp)["forward"] == pytest.approx(0.02)
    assert parts(norms, ddp)["forward"] == parts(PROFILE, fsdp)["forward"] == pytest.approx(0.01)


def test_probe_sizes_stay_within_the_budget():
    # the analytic model only says whether micro-batch 1 is worth timing; the sizes that fit
    # in memory are offered, and the probe's own measured steps pick among them
    cheap = {1: 0.001, 2: 0.002, 4: 0.004, 8: 0.008}
    assert step_probe.probe_micro_batches(cheap, 2) == (1, 2, 4, 8)
    assert step_probe.probe_micro_batches({mb: 10.0 for mb in (1, 2, 4, 8)}, 2) == ()


def test_the_second_size_is_the_largest_the_measured_steps_leave_time_for():
    tried: list[int] = []

    def rounds(fixed_s: float, per_sample_s: float):
        def round_s(mb: int) -> float:
            tried.append(mb)
            return fixed_s + per_sample_s * mb
        return round_s

    sizes = (2, 4, 8, 16)
    # cheap steps: every size is tried and the largest kept
    assert step_probe.scout_size(rounds(0.01, 0.001), 0.011, 1, sizes, 3.0) == (16, pytest.approx(0.026))
    assert tried == [2, 4, 8, 16]
    # a fixed cost dominating: micro-batch 16 costs 0.25 s a round, 16x micro-batch 1 would
    # be 3.2: the measured steps (not proportional scaling) let it in
    tried.clear()
    assert step_probe.scout_size(rounds(0.2, 0.003), 0.203, 1, sizes, 3.0)[0] == 16
    # slow per sample: stops before a size whose timed rounds would pass the budget, untried
    tried.clear()
    assert step_probe.scout_size(rounds(0.02, 0.05), 0.07, 1, sizes, 3.0)[0] == 8
    assert tried == [2, 4, 8]
    tried.clear()
    assert step_probe.scout_size(rounds(1.0, 0.1), 1.1, 1, sizes, 3.0) == (1, 1.1) and not tried


def test_cpu_truth_prints_each_cell_with_its_load():
    import benchmarks.cpu_truth as ct

    cell = {"workload": "gpt", "strategy": "ddp", "precision": "fp32", "ranks": 1, "steps": 20,
            "load_before": 0.4, "load_after": 1.9, "measured_s": 0.2, "predicted_s": 0.25,
            "ratio": 0.8, "micro_batch": 16}
    assert "measured/predicted  0.80  ok" in ct.format_cell(cell)
    assert ct.percentiles([0.5, 0.9, 1.0, 1.1, 1.3], (10, 90)) == pytest.approx((0.66, 1.22))


def test_measure_steps_times_every_part_of_a_real_workload():
    workload = load_workload(WORKLOADS / "mlp.py", ["--hidden", "64", "--depth", "2"])
    t = measure_steps(workload, threads=1, precisions=("fp32", "bf16"), micro_batches=(1, 2, 4))
    assert set(t.precisions) == {"fp32", "bf16"} and t.threads == 1
    for s in t.precisions.values():
        assert [p.micro_batch for p in s.passes] == [1, 4]  # a millisecond step: the largest
        assert all(p.forward_s > 0 and p.backward_s > 0 and p.data_s > 0 for p in s.passes)
        assert s.optimizer_s > 0
    assert WorkloadTiming.from_dict(step_probe.as_cached(t)) == t  # the cache's round trip
    assert "timed on this host" in t.describe()


def test_step_timing_is_cached_per_workload_and_threads_and_never_for_gpus(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("DLAUNCH_CACHE_DIR", str(tmp_path))
    path, args = str(WORKLOADS / "mlp.py"), ["--hidden", "64", "--depth", "2"]
    profile = profile_workload(load_workload(path, args))
    gpu = resolve_topology(topology="h100-sxm-8x", gpus=None, nodes=None)
    assert cached_step_timing(path, args, profile, gpu) is None
    one = topology(1)
    first = cached_step_timing(path, args, profile, one)
    assert first is not None and first.threads == 2  # one rank takes both cores
    monkeypatch.setattr("launcher.plan.resolve.probe_in_child",
                        lambda *a, **k: pytest.fail("a cached step timing was measured again"))
    assert cached_step_timing(path, args, profile, one) == first
    # two ranks on two cores: one thread each, another measurement (skipped here: too big)
    huge = dataclasses.replace(profile, num_params=10**10, bytes_by_dtype={"float32": 4 * 10**10})
    assert cached_step_timing(path, args, huge, topology(2)) is None
    # a workload that fails when timed is remembered too: no second attempt until it changes
    calls: list[int] = []

    def broken(*a: object, **k: object) -> None:
        calls.append(1)
        raise RuntimeError("the workload broke")

    monkeypatch.setattr("launcher.plan.resolve.probe_in_child", broken)
    other = ["--hidden", "32", "--depth", "2"]
    small = profile_workload(load_workload(path, other))
    assert cached_step_timing(path, other, small, one) is None
    assert cached_step_timing(path, other, small, one) is None and calls == [1]


def test_the_step_probe_times_only_the_precisions_the_plan_prices_and_keeps_each(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("DLAUNCH_CACHE_DIR", str(tmp_path))
    path, args = str(WORKLOADS / "mlp.py"), ["--hidden", "48", "--depth", "2"]
    profile = profile_workload(load_workload(path, args))
    asked: list[tuple[str, ...]] = []

    def probe(*a: object, precisions: tuple[str, ...], **k: object) -> WorkloadTiming:
        asked.append(precisions)  # each precision timed as its own pass set: 1 ms a pass per letter
        one = (PassTimes(micro_batch=1, data_s=0.0, forward_s=1e-3 * len(precisions[0]), backward_s=2e-3),)
        return dataclasses.replace(timing(2), precisions={
            p: StepTiming(precision=p, passes=one, optimizer_s=1e-3) for p in precisions})

    monkeypatch.setattr("launcher.plan.resolve.probe_in_child", probe)
    fp32 = cached_step_timing(path, args, profile, topology(1), ("fp32",))
    assert asked == [("fp32",)] and fp32 is not None and set(fp32.precisions) == {"fp32"}
    # a plan that may choose bf16 times bf16 alone; the fp32 timing stays as measured
    both = cached_step_timing(path, args, profile, topology(1), ("fp32", "bf16"))
    assert asked == [("fp32",), ("bf16",)] and both is not None
    assert set(both.precisions) == {"fp32", "bf16"} and both.precisions["fp32"] == fp32.precisions["fp32"]
    assert cached_step_timing(path, args, profile, topology(1), ("bf16",)) == both and len(asked) == 2
    # what the planner prices on a CPU: both where the probe found bf16 rates, one when forced
    assert precisions_for(topology(1), Overrides()) == ["fp32", "bf16"]
    assert precisions_for(topology(1), Overrides(precision="fp32")) == ["fp32"]
    no_bf16 = dataclasses.replace(topology(1).accelerator, peak_tflops={"fp32": 0.1})
    assert precisions_for(dataclasses.replace(topology(1), accelerator=no_bf16), Overrides()) == ["fp32"]


# --- what the model makes of them ----------------------------------------------------------------
def test_compute_comes_from_the_measured_steps_and_time_sharing_stretches_it():
    s = Strategy(kind="ddp", precision="fp32")
    t1 = step_time(PROFILE, s, topology(1), 8, 1, timing=timing(2))
    parts = dict(t1.compute_parts)
    assert parts["forward"] == pytest.approx(0.005) and parts["backward"] == pytest.approx(0.009)
    assert parts["optimizer"] == pytest.approx(0.004)
    # accumulation repeats the micro-batches, not the optimizer step
    t2 = dict(step_time(PROFILE, s, topology(1), 8, 3, timing=timing(2)).compute_parts)
    assert t2["forward"] == pytest.approx(0.015) and t2["optimizer"] == pytest.approx(0.004)
    # four ranks on two cores: each gets half a core, so its measured compute takes twice as long
    four = dict(step_time(PROFILE, s, topology(4), 8, 1, timing=timing(1)).compute_parts)
    assert four["forward"] == pytest.approx(0.010)
    # a precision without a measurement falls back to the probe's rates
    bf16 = step_time(PROFILE, Strategy(kind="ddp", precision="bf16"), topology(1), 8, 1,
                     timing=timing(2))
    assert "forward" not in dict(bf16.compute_parts) and "matmul" in dict(bf16.compute_parts)


def test_gloo_collectives_cost_their_latency_and_bytes_and_nothing_hides():
    assert ddp_buckets(0) == []
    assert ddp_buckets(512 * 1024) == [512 * 1024]
    sizes = ddp_buckets(60 * 2**20)  # 1 MiB, then the rest in 25 MiB-or-less buckets
    assert sizes[0] == 2**20 and len(sizes) == 4 and sum(sizes) == pytest.approx(60 * 2**20)
    ddp = cpu_ddp_comm(PROFILE, topology(2, GLOO2))
    # each bucket: gloo's latency and bytes, and the reducer's handling at the probe's op cost
    handling = DDP_BUCKET_OPS * RATES.op_s
    assert ddp == pytest.approx(sum(1e-3 + b * 1e-9 + handling for b in ddp_buckets(4e6)))
    t = step_time(PROFILE, Strategy(kind="ddp"), topology(2, GLOO2), 8, 1, timing=timing(1))
    assert t.comm_exposed_s == pytest.approx(t.comm_total_s) == pytest.approx(ddp)
    # a probe for other ranks, or none: the link's alpha-beta instead
    assert cpu_ddp_comm(PROFILE, topology(4, GLOO2)) != pytest.approx(ddp)
    # one rank: no communication, but DDP still hands its buckets to a 1-rank gloo group
    gloo1 = dataclasses.replace(GLOO2, ranks=1)
    one = step_time(PROFILE, Strategy(kind="ddp"), topology(1, gloo1), 8, 1, timing=timing(2))
    assert one.comm_total_s == 0
    assert dict(one.compute_parts)["DDP buckets"] == pytest.approx(cpu_ddp_comm(PROFILE, topology(1, gloo1)))
    fsdp = step_time(PROFILE, Strategy(kind="fsdp_full"), topology(1, gloo1), 8, 1, timing=timing(2))
    assert "DDP buckets" not in dict(fsdp.compute_parts)


def test_fsdp_pays_per_unit_collective_and_batch_norm_units_under_bf16():
    fp32, bf16 = Strategy(kind="fsdp_full", precision="fp32"), Strategy(kind="fsdp_full", precision="bf16")
    bn = dataclasses.replace(PROFILE, batch_norms=10)
    assert fsdp_units(bn, fp32) == 4 + 1  # blocks and the root (200k parameters of its own)
    assert fsdp_units(bn, bf16) == 4 + 1 + 10  # and each batch norm under bf16
    top = topology(2, GLOO2)
    assert cpu_sharded_comm(bn, bf16, top, 1) > cpu_sharded_comm(bn, fp32, top, 1)
    grad_op = Strategy(kind="fsdp_grad_op", precision="fp32")
    assert cpu_sharded_comm(PROFILE, grad_op, top, 1) < cpu_sharded_comm(PROFILE, fp32, top, 1)
    # per micro-batch: accumulation repeats the collectives
    assert cpu_sharded_comm(PROFILE, fp32, top, 3) == pytest.approx(3 * cpu_sharded_comm(PROFILE, fp32, top, 1))
    # FSDP's own work is compute even on one rank
    ddp = step_time(PROFILE, Strategy(kind="ddp"), topology(1), 8, 1, timing=timing(2))
    fsdp = step_time(PROFILE, fp32, topology(1), 8, 1, timing=timing(2))
    assert dict(fsdp.compute_parts)["FSDP work"] > 0 and fsdp.compute_s > ddp.compute_s


def test_the_gloo_probe_measures_busy_ranks_and_is_cached(tmp_path: Path):
    rates = measure_gloo(2)  # real: two threads with a gloo group each over loopback
    assert rates.ranks == 2 and set(rates.latency_s) == {"ar", "ag", "rs"}
    assert all(v > 0 for v in rates.latency_s.values())
    assert all(v >= 0 for v in rates.s_per_byte.values())
    cached = cached_gloo_rates(2, tmp_path, measure_fn=lambda n: rates)
    assert cached_gloo_rates(2, tmp_path, measure_fn=lambda n: pytest.fail("measured again")) == cached
    assert cached_gloo_rates(4, tmp_path, measure_fn=lambda n: dataclasses.replace(rates, ranks=n)).ranks == 4


def test_profile_splits_attention_and_convolution_flops_and_counts_batch_norms():
    gpt = profile_workload(load_workload(WORKLOADS / "gpt.py", []))
    resnet = profile_workload(load_workload(WORKLOADS / "resnet.py", []))
    mlp = profile_workload(load_workload(WORKLOADS / "mlp.py", []))
    # gpt tiny: 4 layers of causal attention over 128 tokens at width 256 (4 s^2 d each)
    assert gpt.attention_flops_fwd_per_sample == 4 * 128 * 128 * 256 * 4
    assert gpt.conv_flops_fwd_per_sample == 0 and gpt.batch_norms == 0
    assert resnet.conv_flops_fwd_per_sample > 0.99 * resnet.flops_fwd_per_sample
    assert resnet.batch_norms == 15 and resnet.attention_flops_fwd_per_sample == 0
    assert mlp.attention_flops_fwd_per_sample == mlp.conv_flops_fwd_per_sample == 0


def test_ranks_side_by_side_share_the_memory_bus_and_cache_the_probe_had_alone():
    from launcher.plan.cpu_cost import shared_memory_s, stream_s

    mb = 2**20
    # measured: 80 GB/s over 8 MiB alone, 60 each with both cores streaming; 40 and 20 over 32 MiB
    shared = dataclasses.replace(RATES, stream_curve=((32 * mb, 40.0, 20.0), (8 * mb, 80.0, 60.0)))

    def topo(ranks: int, rates: CpuRates) -> Topology:
        return dataclasses.replace(topology(ranks), accelerator=dataclasses.replace(
            topology(ranks).accelerator, rates=rates))

    assert shared.stream_curve[0][0] == 8 * mb  # sorted by working set
    # 16 MiB sits halfway (in log bytes) between the points: seconds per byte halfway too
    alone = stream_s(16 * mb, 16 * mb, topo(2, shared), ranks=1)
    assert alone == pytest.approx(16 * mb * (1 / 80 + 1 / 40) / 2 / 1e9)
    two = stream_s(16 * mb, 16 * mb, topo(2, shared))  # both cores stream: the all-core column
    assert two == pytest.approx(16 * mb * (1 / 60 + 1 / 20) / 2 / 1e9)
    assert stream_s(mb, 64 * mb, topo(2, shared)) == pytest.approx(mb / 20 / 1e9)  # flat beyond
    assert stream_s(mb, mb, topo(2, shared), ranks=1) == pytest.approx(mb / 80 / 1e9)
    # four ranks on two cores: two stream at once at half a core each, and take turns in one
    # cache, so each running one sees two ranks' working sets (4 MiB each: the 8 MiB point)
    assert stream_s(mb, 4 * mb, topo(4, shared)) == pytest.approx(mb / (60 * 0.5) / 1e9)
    # not measured: the working sets of both ranks in the last-level cache, the rest from memory
    assert stream_s(64 * mb, 64 * mb, topo(2, RATES)) == pytest.approx(64 * mb * (0.25 / 60 + 0.75 / 20) / 1e9)
    assert stream_s(64 * mb, 64 * mb, topo(2, RATES), ranks=1) == pytest.approx(
        64 * mb * (0.5 / 60 + 0.5 / 20) / 1e9)
    big = dataclasses.replace(PROFILE, num_params=10**7, bytes_by_dtype={"float32": 4 * 10**7})
    s = Strategy(kind="ddp")
    extra = shared_memory_s(big, "fp32", topo(2, shared), 8, 1, 1, 0.0)
    assert extra > 0 and shared_memory_s(big, "fp32", topo(1, shared), 8, 1, 1, 0.0) == 0.0
    parts = dict(step_time(big, s, topo(2, shared), 8, 1, timing=timing(1)).compute_parts)
    assert parts["shared memory"] == pytest.approx(extra)
    assert "shared memory" not in dict(step_time(big, s, topo(1, shared), 8, 1, timing=timing(2)).compute_parts)


def test_the_probe_sizes_follow_the_precisions_it_times():
    # bf16 priced ~1,000x slower than fp32 (a CPU without native bf16): timing it would not fit
    # the probe's budget, fp32 alone does
    slow = dataclasses.replace(RATES, gemm_gflops={"fp32": 100.0, "bf16": 0.1})
    topo = dataclasses.replace(topology(1), accelerator=dataclasses.replace(topology(1).accelerator, rates=slow))
    big = dataclasses.replace(PROFILE, flops_fwd_per_sample=2e8)
    assert _probe_sizes(big, topo, ("fp32",))[:1] == (1,)
    assert _probe_sizes(big, topo, ("fp32", "bf16")) == ()

"""The CPU probe (real measurements, cached per machine) and the CPU step-time model it feeds."""

from __future__ import annotations

import dataclasses
import datetime
import json
from pathlib import Path

import pytest

from launcher.hardware.detect import cpu_info
from launcher.hardware.types import DeviceSpec, Link, Topology
from launcher.plan import cpu_probe, resolve
from launcher.plan.cost import step_time
from launcher.plan.cpu_cost import cpu_forward, cpu_overhead
from launcher.plan.cpu_rates import PARALLEL_EFFICIENCY, CpuRates, ProbedCpu, core_share, op_share
from launcher.plan.host_quiet import IGNORE_LOAD_ENV
from launcher.plan.profile import profile_workload
from launcher.plan.resolve import cached_cpu_rates, probe_cache_dir, resolve_topology
from launcher.specs import ModelProfile, Strategy
from launcher.workload import load_workload

from tests.helpers import WORKLOADS


def rates(fp32: float = 100.0, bf16: float = 50.0) -> CpuRates:
    return CpuRates(gemm_gflops={"fp32": fp32, "bf16": bf16}, half_rows={"fp32": 1.0, "bf16": 1.0},
                    mem_gb_s=5.0, cache_gb_s=20.0, cast_gb_s=5.0, llc_bytes=32 * 2**20, cores=2)


def cpu_topology(ranks: int, *, cores: int = 2, r: CpuRates | None = None) -> Topology:
    dev = ProbedCpu(name="probed", mem_gib=8, peak_tflops={"fp32": 0.1}, rates=r or rates())
    return Topology(name="cpu", device="cpu", num_nodes=1, devices_per_node=ranks,
                    accelerator=dev, cpu_cores_per_node=cores,
                    intra_node=Link(kind="shm", bw_gb_s=1.0, latency_us=100))


def model(*, params: int, flops_per_sample: float, tokens: int = 1, ops: int = 0,
          tensors: int = 0) -> ModelProfile:
    return ModelProfile(name="m", num_params=params, bytes_by_dtype={"float32": 4 * params},
                        forward_ops=ops, param_tensors=tensors,
                        num_blocks=4, largest_block_params=params // 4,
                        activation_bytes_per_sample=64.0 * tokens * 256,
                        block_input_bytes_per_sample=4.0 * tokens * 256,
                        flops_fwd_per_sample=flops_per_sample, units_per_sample=tokens,
                        sample_units="tokens" if tokens > 1 else "samples")


# a transformer-like model (weights reused over 512 tokens) and a skinny MLP (used once per sample)
LARGE = model(params=4_000_000, flops_per_sample=2 * 4_000_000 * 512, tokens=512)
SKINNY = model(params=1_000_000, flops_per_sample=2 * 1_000_000)


# --- the probe and its cache ---------------------------------------------------------------------
def test_probe_measures_and_caches_per_machine(tmp_path: Path):
    first = cached_cpu_rates(tmp_path)  # a real measurement (well under a second)
    assert first.gemm_gflops["fp32"] > 0 and first.gemm_gflops["bf16"] > 0
    assert first.mem_gb_s > 0 and first.cache_gb_s >= first.mem_gb_s and first.measured_at
    # streaming by working set, alone and with every core streaming: one point per size
    assert [p[0] for p in first.stream_curve] == [m * 2**20 for m in cpu_probe.STREAM_MIB]
    assert first.mem_gb_s == first.stream_curve[-1][1]
    # per-op overhead: an op building the autograd graph costs more than a plain one, and a
    # backward() call more than either (the autograd engine's start-up)
    assert 0 < first.op_s < first.backward_call_s and first.graph_op_s > 0
    # how a rank's work scales with its threads here: GEMM, streaming, tiny ops at 1..cores
    counts = [float(n) for n in cpu_probe.scaling_threads(first.cores)]
    assert set(first.thread_speedup) == {"gemm", "stream", "op"}
    assert all([n for n, _ in points] == counts and points[0] == (1.0, 1.0)
               for points in first.thread_speedup.values())
    assert first.cpu_flags and not first.validated_at
    [entry] = list(tmp_path.glob("*.json"))
    assert json.loads(entry.read_text())["gemm_gflops"] == dict(first.gemm_gflops)

    def must_not_measure() -> CpuRates:
        raise AssertionError("a cached probe measured again")

    assert cached_cpu_rates(tmp_path, measure_fn=must_not_measure) == first
    # a corrupt entry is measured again, not trusted
    entry.write_text("{not json")
    assert cached_cpu_rates(tmp_path, measure_fn=lambda: rates()) == rates()


def test_cache_key_names_cpu_cores_and_torch():
    base = cpu_probe.cache_key("Xeon 8480", 8, "2.13.0")
    assert base == cpu_probe.cache_key("Xeon 8480", 8, "2.13.0")
    assert len({base, cpu_probe.cache_key("EPYC 9654", 8, "2.13.0"),
                cpu_probe.cache_key("Xeon 8480", 4, "2.13.0"),
                cpu_probe.cache_key("Xeon 8480", 8, "2.14.0")}) == 4


def test_scaling_is_measured_at_1_2_and_the_largest_thread_counts():
    assert cpu_probe.scaling_threads(1) == (1,)
    assert cpu_probe.scaling_threads(2) == (1, 2)
    assert cpu_probe.scaling_threads(6) == (1, 2, 4, 6)
    assert cpu_probe.scaling_threads(64) == (1, 2, 8, 16, 32, 64)  # cores // ranks kept


def _aged(r: CpuRates, hours: float, flags: str) -> CpuRates:
    then = datetime.datetime.now() - datetime.timedelta(hours=hours)
    return dataclasses.replace(r, measured_at=then.isoformat(timespec="seconds"), cpu_flags=flags)


def test_a_cached_probe_is_revalidated_after_a_day_or_on_other_cpu_flags(tmp_path: Path):
    flags = cpu_probe.flags_digest(cpu_info().flags)
    info = cpu_info()
    entry = tmp_path / f"{cpu_probe.cache_key(info.model, info.usable_cores, cpu_probe.torch_version())}.json"
    measured: list[int] = []
    remeasured: list[float] = []

    def measure() -> CpuRates:
        measured.append(1)
        return _aged(rates(fp32=80.0), 0, flags)

    def gemm(value: float):
        def fn() -> float:
            remeasured.append(value)
            return value
        return fn

    def cache(r: CpuRates) -> None:
        entry.write_text(json.dumps(dataclasses.asdict(r)))

    # fresh: used as cached, nothing re-measured
    cache(_aged(rates(), 2, flags))
    assert cached_cpu_rates(tmp_path, measure_fn=measure, gemm_fn=gemm(100.0)).gemm_gflops["fp32"] == 100
    assert not measured and not remeasured
    # 30 h old, the GEMM within REVALIDATE_TOLERANCE: kept, stamped valid (not re-measured next)
    cache(_aged(rates(), 30, flags))
    kept = cached_cpu_rates(tmp_path, measure_fn=measure, gemm_fn=gemm(110.0))
    assert kept.gemm_gflops["fp32"] == 100 and kept.validated_at and remeasured == [110.0]
    assert cached_cpu_rates(tmp_path, measure_fn=measure, gemm_fn=gemm(50.0)) == kept
    assert remeasured == [110.0] and not measured
    # 30 h old and the GEMM moved by more: probed again
    cache(_aged(rates(), 30, flags))
    assert cached_cpu_rates(tmp_path, measure_fn=measure, gemm_fn=gemm(130.0)).gemm_gflops["fp32"] == 80
    assert measured == [1]
    # taken on a CPU with other ISA flags behind the same model name: re-validated at once
    cache(_aged(rates(), 1, "other-flags"))
    cached_cpu_rates(tmp_path, measure_fn=measure, gemm_fn=gemm(100.0))
    assert remeasured[-1] == 100.0 and measured == [1]
    assert cpu_probe.needs_revalidation(_aged(rates(), 1, "x"), datetime.datetime.now(), "y")


def test_a_probe_disturbed_by_other_work_is_never_cached_and_a_cached_one_is_measured_again(tmp_path: Path,
                                                                                            monkeypatch):
    # a probe taken beside a test suite's workers: two threads 0.14x as fast as one, each core
    # streaming side by side at 0.3 of 50 GB/s (the cached entry that made plans 5x too slow)
    flags = cpu_probe.flags_digest(cpu_info().flags)
    info = cpu_info()
    entry = tmp_path / f"{cpu_probe.cache_key(info.model, info.usable_cores, cpu_probe.torch_version())}.json"
    disturbed = dataclasses.replace(_aged(rates(), 0, flags), thread_speedup={"gemm": ((1, 1.0), (2, 0.136))})
    assert "gemm work ran 0.14x as fast on 2 threads" in (disturbed.implausible() or "")
    streams = dataclasses.replace(rates(), stream_curve=((2.0**20, 50.0, 0.3),))
    assert "side by side got 0.3 GB/s against 50 alone" in (streams.implausible() or "")
    idle = dataclasses.replace(_aged(rates(fp32=80.0), 0, flags), thread_speedup={"gemm": ((1, 1.0), (2, 1.9))},
                               stream_curve=((2.0**20, 50.0, 40.0),))
    assert idle.implausible() is None
    # 16 MiB fits the cache alone (68 GB/s) but not twice over: side by side it gets memory's 20 / 2
    cache_bound = dataclasses.replace(rates(), stream_curve=((2.0**24, 68.0, 10.0), (2.0**26, 20.0, 10.0)))
    assert cache_bound.implausible() is None
    measured: list[CpuRates] = []
    # as a user runs it: the load heeded (the suite ignores it), and the host quiet around the
    # instant fake probes (what `host_quiet` says of them is noise)
    monkeypatch.delenv(IGNORE_LOAD_ENV, raising=False)
    monkeypatch.setattr(resolve, "cacheable", lambda quiet: True)

    def measure(result: CpuRates):
        def fn() -> CpuRates:
            measured.append(result)
            return result
        return fn

    # measured implausibly: used, not cached
    assert cached_cpu_rates(tmp_path, measure_fn=measure(disturbed)) == disturbed and not entry.exists()
    # a cached one that is implausible is measured again, and the plausible result cached
    entry.write_text(json.dumps(dataclasses.asdict(disturbed)))
    assert cached_cpu_rates(tmp_path, measure_fn=measure(idle)).gemm_gflops["fp32"] == 80
    assert measured == [disturbed, idle] and json.loads(entry.read_text())["gemm_gflops"]["fp32"] == 80
    # the suite (load ignored, a cache of its own) keeps what it measured, as before
    monkeypatch.setenv(IGNORE_LOAD_ENV, "1")
    entry.write_text(json.dumps(dataclasses.asdict(disturbed)))
    assert cached_cpu_rates(tmp_path, measure_fn=measure(idle)) == disturbed and len(measured) == 2


def test_half_rows_and_llc_from_sysfs(tmp_path: Path):
    # a skinny GEMM of 8 rows at half the large rate: rate(r) = R r / (r + 8) halves at 8 rows
    assert cpu_probe.half_rows(100.0, 50.0, 8) == pytest.approx(8.0)
    assert cpu_probe.half_rows(100.0, 120.0, 8) == 0.0  # never negative
    for index, size in (("index0", "48K"), ("index2", "1280K"), ("index3", "32M")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    assert cpu_probe.llc_bytes(tmp_path) == 32 * 2**20
    assert cpu_probe.llc_bytes(tmp_path / "missing") == 0.0


def test_cpu_plans_use_the_probe_and_gpu_plans_never_run_it(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("DLAUNCH_CACHE_DIR", str(tmp_path))
    gpu = resolve_topology(topology="h100-sxm-8x", gpus=None, nodes=None)
    assert not isinstance(gpu.accelerator, ProbedCpu)
    assert not probe_cache_dir().exists()
    topo = resolve_topology(topology="cpu-local", gpus=2, nodes=None)
    dev = topo.accelerator
    assert isinstance(dev, ProbedCpu) and "measured by the CPU probe" in dev.name
    assert list(probe_cache_dir().glob("*.json"))
    # the listed peak is replaced: one process's share of the measured host rate
    cores = topo.cpu_cores_per_node
    assert dev.peak_tflops["fp32"] == pytest.approx(
        dev.rates.gemm_gflops["fp32"] * cores / 2 / 1e3, rel=1e-3)


# --- the CPU model -------------------------------------------------------------------------------
def test_more_ranks_than_cores_share_them():
    assert core_share(cpu_topology(1, cores=2)) > 1.0  # two threads
    assert core_share(cpu_topology(2, cores=2)) == 1.0
    assert core_share(cpu_topology(4, cores=2)) == 0.5
    fp32 = Strategy(kind="ddp", precision="fp32")
    per_rank = {n: step_time(LARGE, fp32, cpu_topology(n), 4, 1) for n in (1, 2, 4)}
    assert per_rank[1].compute_s < per_rank[2].compute_s < per_rank[4].compute_s
    # half a core each, and half the last-level cache: at least twice as slow
    assert per_rank[4].compute_s >= 2 * per_rank[2].compute_s
    # gloo's copies share the cores too: the same bytes take longer over 4 ranks on 2 cores
    assert per_rank[4].comm_total_s > per_rank[2].comm_total_s


def test_a_ranks_threads_speed_up_its_work_as_the_probe_measured_them():
    def scaled(gemm: float, stream: float, op: float) -> CpuRates:
        return dataclasses.replace(rates(), thread_speedup={
            "gemm": ((1, 1.0), (2, gemm)), "stream": ((1, 1.0), (2, stream)), "op": ((1, 1.0), (2, op))})

    smt, physical = cpu_topology(1, r=scaled(1.2, 1.1, 1.0)), cpu_topology(1, r=scaled(2.0, 1.6, 0.9))
    assert core_share(physical) == 2.0 and core_share(physical, "stream") == 1.6
    assert core_share(smt) == 1.2 and op_share(physical) == 0.9
    assert op_share(cpu_topology(1, r=scaled(2.0, 1.6, 1.3))) == 1.0  # a tiny op cannot gain
    # unmeasured (an old cache) or read on a busy host (< 1): the assumed efficiency
    assert core_share(cpu_topology(1)) == pytest.approx(1 + PARALLEL_EFFICIENCY)
    assert core_share(cpu_topology(1, r=scaled(0.2, 0.1, 0.9))) == pytest.approx(1 + PARALLEL_EFFICIENCY)
    # one thread per rank, or ranks time-sharing cores: no scaling applies
    assert core_share(cpu_topology(2, r=scaled(2.0, 1.6, 0.9))) == 1.0
    assert core_share(cpu_topology(4, r=scaled(2.0, 1.6, 0.9))) == op_share(cpu_topology(4)) == 0.5
    fp32 = Strategy(kind="ddp", precision="fp32")
    fwd = {name: cpu_forward(LARGE, fp32, 4, t) for name, t in (("smt", smt), ("physical", physical))}
    assert fwd["smt"].gemm_s == pytest.approx(fwd["physical"].gemm_s * 2.0 / 1.2)
    assert fwd["smt"].memory_s > fwd["physical"].memory_s
    assert step_time(LARGE, fp32, smt, 4, 1).compute_s > step_time(LARGE, fp32, physical, 4, 1).compute_s
    # interpolated between measured thread counts, flat beyond the last
    r = dataclasses.replace(rates(), thread_speedup={"gemm": ((1, 1.0), (2, 1.8), (4, 3.0))})
    assert r.speedup("gemm", 3) == pytest.approx(2.4) and r.speedup("gemm", 8) == 3.0
    assert r.speedup("stream", 2) is None


def test_bf16_helps_large_gemms_only_where_the_probe_says_it_is_faster():
    fp32, bf16 = Strategy(kind="ddp", precision="fp32"), Strategy(kind="ddp", precision="bf16")
    fast_bf16 = cpu_topology(2, r=rates(fp32=100.0, bf16=300.0))  # native bf16 (AMX-like)
    slow_bf16 = cpu_topology(2, r=rates(fp32=100.0, bf16=15.0))  # emulated bf16
    assert step_time(LARGE, bf16, fast_bf16, 4, 1).compute_s < \
        step_time(LARGE, fp32, fast_bf16, 4, 1).compute_s
    assert step_time(LARGE, bf16, slow_bf16, 4, 1).compute_s > \
        step_time(LARGE, fp32, slow_bf16, 4, 1).compute_s
    # a skinny model gains far less from fast bf16 GEMMs: casts and weight traffic stay
    gain = {name: step_time(p, fp32, fast_bf16, 8, 1).compute_s
            / step_time(p, bf16, fast_bf16, 8, 1).compute_s for name, p in
            (("large", LARGE), ("skinny", SKINNY))}
    assert gain["skinny"] < gain["large"]


def test_cpu_communication_is_not_hidden():
    t = step_time(LARGE, Strategy(kind="ddp"), cpu_topology(2), 4, 1)
    assert t.comm_total_s > 0 and t.comm_exposed_s == pytest.approx(t.comm_total_s)
    assert t.step_time_s == pytest.approx(t.compute_s + t.comm_total_s)


def test_an_unprobed_cpu_topology_uses_its_listed_peak():
    listed = DeviceSpec(name="listed", mem_gib=8, peak_tflops={"fp32": 0.05})
    base = cpu_topology(2)
    slow = dataclasses.replace(base, accelerator=listed)
    fast = dataclasses.replace(base, accelerator=dataclasses.replace(listed,
                                                                     peak_tflops={"fp32": 0.5}))
    s = Strategy(kind="ddp")
    assert step_time(LARGE, s, fast, 4, 1).compute_s < step_time(LARGE, s, slow, 4, 1).compute_s


# --- per-op overhead -----------------------------------------------------------------------------
def test_profile_counts_forward_ops_and_parameter_tensors():
    shallow = profile_workload(load_workload(WORKLOADS / "mlp.py", ["--depth", "2"]))
    deep = profile_workload(load_workload(WORKLOADS / "mlp.py", ["--depth", "6"]))
    # each block is a Linear and a GELU: a weight and a bias, and a few aten ops
    assert deep.param_tensors - shallow.param_tensors == 8
    assert deep.forward_ops > shallow.forward_ops > 0
    assert (deep.forward_ops - shallow.forward_ops) % 4 == 0


def test_a_tiny_models_cpu_step_is_op_overhead_and_grows_with_ops():
    fp32, topo = Strategy(kind="ddp", precision="fp32"), cpu_topology(1)
    tiny = {ops: model(params=676, flops_per_sample=2 * 676, ops=ops, tensors=4) for ops in (7, 70)}
    times = {ops: step_time(p, fp32, topo, 8, 1) for ops, p in tiny.items()}
    parts = dict(times[7].compute_parts)
    assert parts["op overhead"] > 0.9 * times[7].compute_s
    assert times[7].compute_s > 1e-4  # not the microseconds its FLOPs and bytes take
    assert times[70].compute_s > 2 * times[7].compute_s
    # every micro-batch pays its ops again; the optimizer step once per step
    accumulated = step_time(tiny[7], fp32, topo, 8, 4).compute_s
    assert times[7].compute_s < accumulated < 4 * times[7].compute_s
    # ranks time-sharing a core wait for it: 4 ranks on 2 cores take twice as long per op
    assert cpu_overhead(tiny[7], cpu_topology(4)).step_s(1, 0.0) == pytest.approx(
        2 * cpu_overhead(tiny[7], cpu_topology(2)).step_s(1, 0.0))


def test_a_profile_without_an_op_count_adds_no_overhead():
    assert cpu_overhead(SKINNY, cpu_topology(2)).step_s(4, 1.0) == 0.0

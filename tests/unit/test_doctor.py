"""`dlaunch doctor` without torchrun: the verdict rule (median, threshold, failed ranks, nodes and
the --exclude list), the expectations and their sources, reading rank files, the rank program's
pure parts, the launch spec and dry run, and bad input (one line, exit 2, nothing written)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from launcher.drivers.doctor import DOCTOR_RANK, Basis, DoctorRequest, doctor_spec, expectations, topology_file
from launcher.errors import UsageError
from launcher.files import append_lines, atomic_write_json
from launcher.hardware.gpu_probe import count_gpus
from launcher.hardware.topology import load_topology
from launcher.plan.cpu_rates import CpuRates, GlooRates, ProbedCpu
from launcher.plan.expected import COPY_PEAK_FRACTION, cpu_expectations, gpu_expectations, no_expectations
from launcher.plan.gemm import GEMM_PEAK_FRACTION
from launcher.results.doctor import RankReading, judge, read_readings, reading_from_summary
from launcher.results.doctor_view import format_doctor
from launcher.rundir import RunPaths
from launcher.runtime.doctor_checks import SLOW_RANK_ENV, busbw, pick_precision, slowed_rank

from tests.helpers import assert_one_line_error, run_dlaunch

GIB = 2**30
NONE = no_expectations("nothing")


def reading(rank: int, *, node: int = 0, host: str = "n1", gemm: float = 100e12, copy: float = 3e12,
            node_bw: float | None = None, world_bw: float | None = None, local: int = 0,
            device: str = "cuda") -> RankReading:
    return RankReading(rank=rank, host=host, node=node, local_rank=local, device=device,
                       device_name="NVIDIA H100", precision="bf16", gemm=gemm, gemm_n=8192,
                       copy=copy, copy_bytes=2 * GIB, allreduce_node=node_bw, node_ranks=2,
                       allreduce_world=world_bw, world_size=4, allreduce_bytes=GIB // 2)


def two_nodes(**slow: float) -> list[RankReading]:
    """4 ranks on nodes n1 (ranks 0, 1) and n2 (ranks 2, 3); `slow` scales rank 3's rates."""
    out = []
    for rank in range(4):
        node = rank // 2
        r = reading(rank, node=node, host=f"n{node + 1}", local=rank % 2, node_bw=300e9, world_bw=100e9)
        if rank == 3:
            r = dataclasses.replace(r, **{k: getattr(r, k) * v for k, v in slow.items()})
        out.append(r)
    return out


# -- the verdict rule ----------------------------------------------------------------------------

def test_a_healthy_job_is_ok_and_exits_clean():
    report = judge(two_nodes(), NONE, slurm=True)
    assert report.ok and report.exclude == () and not any(r.slow for r in report.ranks)
    text = format_doctor(report)
    assert "ok: every rank within 80% of the median" in text
    assert len([ln for ln in text.splitlines() if ln.endswith("  ok")]) >= 4


def test_a_slow_rank_is_named_with_its_node_and_the_exclude_value():
    report = judge(two_nodes(gemm=0.5), NONE, slurm=True)
    assert not report.ok
    assert [r.reading.rank for r in report.ranks if r.slow] == [3]
    assert [n.host for n in report.nodes if n.bad] == ["n2"] and report.exclude == ("n2",)
    text = format_doctor(report)
    assert "SLOW: rank 3 (cuda:1 on n2, node 1): GEMM" in text
    assert "exclude: --exclude=n2" in text and "--slurm-opt exclude=n2" in text
    assert "SLOW: rank 0" not in text
    data = json.loads(json.dumps(report.to_dict()))  # strictly JSON
    assert data["slow_ranks"] == [3] and data["exclude"] == "n2" and data["ok"] is False
    assert data["ranks"][3]["gemm"]["of_median"] == pytest.approx(0.5)  # median of 1, 1, 1, 0.5


def test_the_threshold_is_a_fraction_of_the_median():
    # 4 ranks, one at 0.85: the median is 1.0, 0.85 >= 0.8 is ok; at threshold 0.9 it is SLOW
    assert judge(two_nodes(copy=0.85), NONE).ok
    report = judge(two_nodes(copy=0.85), NONE, threshold=0.9)
    assert [r.reading.rank for r in report.ranks if r.slow] == [3]
    # a local run names ranks, never an --exclude
    assert "--exclude" not in format_doctor(report) and report.to_dict()["exclude"] is None


def test_a_slow_all_reduce_makes_its_node_bad():
    readings = two_nodes()
    readings[2] = dataclasses.replace(readings[2], allreduce_node=100e9)
    readings[3] = dataclasses.replace(readings[3], allreduce_node=100e9)
    three = readings + [dataclasses.replace(r, rank=r.rank + 4, node=r.node + 2, host=f"n{r.node + 3}")
                        for r in two_nodes()]
    report = judge(three, NONE, slurm=True)
    assert not any(r.slow for r in report.ranks)
    assert report.exclude == ("n2",)
    assert "SLOW: node 1 (n2): all-reduce busbw 100 GB/s" in format_doctor(report)


def test_a_failed_rank_fails_the_doctor_and_its_node():
    readings = two_nodes()
    readings[1] = RankReading(rank=1, host="n1", node=0, local_rank=1, device="cuda", status="failed",
                              error="RuntimeError: CUDA error: uncorrectable ECC error")
    # a rank torchrun stopped because of it says nothing against its own node
    readings[2] = RankReading(rank=2, host="n2", node=1, local_rank=0, device="cuda", status="stopped",
                              error="SIGTERM from torchrun after another rank failed (no summary)")
    report = judge(readings, NONE, slurm=True)
    assert not report.ok and report.exclude == ("n1",)
    text = format_doctor(report)
    assert "FAILED: rank 1 (host n1): RuntimeError: CUDA error" in text
    assert "STOPPED: rank 2 (host n2): SIGTERM from torchrun" in text
    assert [(f["rank"], f["status"]) for f in report.to_dict()["failed"]] == [(1, "failed"), (2, "stopped")]


def test_one_rank_has_nothing_to_compare_with():
    report = judge([reading(0)], NONE)
    assert report.ok
    assert "one rank: nothing to compare with" in format_doctor(report)


def test_a_median_far_below_the_expectation_is_noted_not_failed():
    topo = load_topology("h100-sxm-8x")
    exp = gpu_expectations(topo, precision="bf16", nodes=1, basis="topology h100-sxm-8x")
    report = judge([reading(0, gemm=300e12), reading(1, gemm=310e12)], exp)
    assert report.ok
    assert any("median rank's GEMM is 39% of the expected 792 TFLOP/s" in n for n in report.notes)
    text = format_doctor(report)
    assert "300 / 792  38%" in text and len(report.notes) == 1 and "expected: topology h100-sxm-8x" in text


# -- expectations ---------------------------------------------------------------------------------

def test_gpu_expectations_are_the_topology_peaks_times_achievable_fractions():
    exp = gpu_expectations(load_topology("h100-sxm-8x4node-ib"), precision="bf16", nodes=4, basis="b")
    gemm, copy = exp.checks["gemm"], exp.checks["copy"]
    assert gemm is not None and gemm.peak == 989e12 and gemm.fraction == GEMM_PEAK_FRACTION[(9, 0)]
    assert gemm.value == pytest.approx(989e12 * 0.801) and "dense bf16 peak 989" in gemm.source
    assert copy is not None and copy.value == pytest.approx(3350e9 * COPY_PEAK_FRACTION)
    assert "HBM 3350 GB/s" in copy.source
    node, world = exp.checks["allreduce_node"], exp.checks["allreduce_world"]
    assert node is not None and node.value == 370e9 and "the nvswitch link" in node.source
    assert world is not None and world.value == 370e9 and "infiniband" in world.source
    # a dtype the device does not list has no expectation, and says why
    v100 = gpu_expectations(load_topology("v100-sxm-8x"), precision="bf16", nodes=1, basis="b")
    assert v100.checks["gemm"] is None and "lists no bf16 peak" in v100.missing["gemm"]


def _probed(ranks: int, *, gloo: GlooRates | None = None):
    rates = CpuRates(gemm_gflops={"fp32": 90.0, "bf16": 200.0}, half_rows={"fp32": 1.0},
                     mem_gb_s=25.0, cache_gb_s=70.0, cast_gb_s=20.0,
                     stream_curve=((2**20, 50.0, 45.0), (64 * 2**20, 25.0, 16.0)), cores=2,
                     cpu_model="EPYC", measured_at="2026-01-02T03:04:05")
    topo = load_topology("cpu-local").with_shape(num_nodes=1, devices_per_node=ranks)
    accel = ProbedCpu(name="EPYC - one of 2", mem_gib=1.0, peak_tflops={"fp32": 0.09},
                      rates=rates, gloo=gloo)
    return dataclasses.replace(topo, accelerator=accel, cpu_cores_per_node=2)


def test_cpu_expectations_from_this_hosts_probes():
    gloo = GlooRates(ranks=2, latency_s={"ar": 1e-4, "ag": 1e-4, "rs": 1e-4},
                     s_per_byte={"ar": 1e-9, "ag": 1e-9, "rs": 1e-9})
    exp = cpu_expectations(_probed(2, gloo=gloo), precision="fp32", ranks_per_node=2, nodes=1,
                           threads=1, copy_bytes=64 * 2**20, allreduce_bytes=16 * 2**20, basis="probe")
    gemm, copy, ar = exp.checks["gemm"], exp.checks["copy"], exp.checks["allreduce_node"]
    assert gemm is not None and gemm.value == pytest.approx(90e9) and gemm.fraction == 1.0
    assert "CPU probe of this host (2026-01-02 03:04:05)" in gemm.source
    # both ranks stream at once on the 2 cores: the side-by-side column at 64 MiB
    assert copy is not None and copy.value == pytest.approx(16e9) and "every core streaming" in copy.source
    size = 16 * 2**20
    assert ar is not None and ar.value == pytest.approx(size / (1e-4 + size * 1e-9))  # 2 ranks: x 1
    assert "gloo probe" in ar.source
    # one rank with both cores: its second thread at the planner's 0.6, both streams
    one = cpu_expectations(_probed(1), precision="bf16", ranks_per_node=1, nodes=1, threads=2,
                           copy_bytes=128 * 2**20, allreduce_bytes=0, basis="probe")
    assert one.checks["gemm"].value == pytest.approx(200e9 * 1.6)  # type: ignore[union-attr]
    assert one.checks["copy"].value == pytest.approx(32e9)  # type: ignore[union-attr]
    assert one.checks["allreduce_node"] is None
    # where the probe measured the GEMM's thread scaling, the expectation takes it (as the planner)
    probed = _probed(1)
    rates = dataclasses.replace(probed.accelerator.rates, thread_speedup={"gemm": ((1, 1.0), (2, 1.9))})
    scaled = dataclasses.replace(probed, accelerator=dataclasses.replace(probed.accelerator, rates=rates))
    two = cpu_expectations(scaled, precision="bf16", ranks_per_node=1, nodes=1, threads=2,
                           copy_bytes=128 * 2**20, allreduce_bytes=0, basis="probe")
    assert two.checks["gemm"].value == pytest.approx(200e9 * 1.9)  # type: ignore[union-attr]
    assert "measured GEMM speedup" in two.checks["gemm"].source  # type: ignore[union-attr]


def test_cpu_expectations_from_a_topology_file_share_its_listed_peak():
    exp = cpu_expectations(load_topology("cpu-local"), precision="fp32", ranks_per_node=2, nodes=2,
                           threads=1, copy_bytes=64 * 2**20, allreduce_bytes=16 * 2**20, basis="file")
    gemm = exp.checks["gemm"]
    assert gemm is not None and gemm.value == pytest.approx(0.041e12 * 4 / 2)
    assert exp.checks["copy"] is None and "no memory bandwidth" in exp.missing["copy"]
    assert exp.checks["allreduce_node"].value == 0.5e9  # type: ignore[union-attr]
    assert exp.checks["allreduce_world"].value == 0.5e9  # type: ignore[union-attr]


def test_expectations_use_what_the_ranks_measured():
    request = DoctorRequest(device="cuda", ranks_per_node=2)
    basis = Basis(topology=load_topology("a100-sxm-8x"), text="topology a100")
    exp = expectations(basis, [dataclasses.replace(reading(0), precision="fp16")], request)
    assert exp.checks["gemm"].peak == 312e12  # type: ignore[union-attr]
    assert expectations(Basis(topology=None, text="none"), [reading(0)], request).checks["gemm"] is None


# -- rank files ----------------------------------------------------------------------------------

def test_readings_from_summaries_and_failed_ranks_from_their_start_record(tmp_path: Path):
    paths = RunPaths(root=tmp_path)
    doc = {"device": "cpu", "device_name": "EPYC", "host": "h", "node_rank": 0, "local_rank": 0,
           "local_world_size": 2, "world_size": 2, "precision": "fp32", "threads": 1, "slowed": True,
           "gemm": {"rate": 9e10, "n": 1024}, "copy": {"rate": 1.5e10, "bytes": 2**26},
           "allreduce_node": {"busbw": 1.2e9, "bytes": 2**24}, "allreduce_world": None}
    atomic_write_json(paths.summary(0), {"rank": 0, "status": "ok", "doctor": doc})
    append_lines(paths.records(1), [{"kind": "start", "host": "h", "node_rank": 0, "local_rank": 1,
                                     "device": "cpu"}])
    atomic_write_json(paths.summary(1), {"rank": 1, "status": "failed", "error": "boom"})
    ok, failed, missing = read_readings(tmp_path, 3)
    assert ok.gemm == 9e10 and ok.copy_bytes == 2**26 and ok.allreduce_node == 1.2e9 and ok.slowed
    assert ok.allreduce_world is None and ok.allreduce_bytes == 2**24 and not ok.error
    assert failed.error == "boom" and (failed.host, failed.local_rank, failed.status) == ("h", 1, "failed")
    assert "left no result" in missing.error and missing.host == "?"
    assert reading_from_summary(0, {"status": "ok"}).error  # no doctor part: no measurement


# -- the rank program's pure parts -------------------------------------------------------------

def test_rank_program_helpers():
    assert pick_precision("auto", "cuda", (9, 0)) == "bf16"
    assert pick_precision("auto", "cuda", (7, 0)) == "fp32"
    assert pick_precision("auto", "cpu", None) == "fp32"
    assert pick_precision("fp16", "cuda", (7, 0)) == "fp16"
    assert busbw(8e9, 1.0, 8) == pytest.approx(8e9 * 14 / 8)  # nccl-tests: 2 (n - 1) / n
    assert slowed_rank({SLOW_RANK_ENV: "1"}) == 1 and slowed_rank({}) is None
    assert slowed_rank({SLOW_RANK_ENV: "x"}) is None


# -- launching -------------------------------------------------------------------------------------

def test_the_launch_spec_runs_the_rank_script_under_the_watcher(tmp_path: Path):
    request = DoctorRequest(device="cpu", ranks_per_node=2, precision="bf16")
    spec = doctor_spec(request, run_id="doctor-x", run_dir=str(tmp_path))
    assert spec.is_script and spec.workload == str(DOCTOR_RANK) and DOCTOR_RANK.is_file()
    assert spec.workload_args == ("--device", "cpu", "--precision", "bf16")
    assert spec.world_size == 2 and 0 < spec.hang_timeout_s <= 60
    with pytest.raises(UsageError, match="fp16: CPU ranks"):
        DoctorRequest(device="cpu", ranks_per_node=2, precision="fp16")
    with pytest.raises(UsageError, match="--threshold"):
        DoctorRequest(device="cpu", ranks_per_node=2, threshold=0.0)
    with pytest.raises(UsageError, match="describes cuda devices, but this host runs cpu"):
        topology_file(DoctorRequest(device="cpu", ranks_per_node=2, topology="h100-sxm-8x"))


def test_dry_run_prints_the_torchrun_command_and_starts_nothing(tmp_path: Path):
    done = run_dlaunch("doctor", "--dry-run", "--gpus", "2", cwd=tmp_path,
                       env={"CUDA_VISIBLE_DEVICES": ""})
    assert done.code == 0, done.err
    assert "torch.distributed.run" in done.out and "doctor_rank.py --device cpu --precision auto" in done.out
    assert "OMP_NUM_THREADS=" in done.out and "--nproc-per-node 2" in done.out
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("argv, needles", [
    (["--threshold", "1.5"], ("--threshold must be a fraction in (0, 1]",)),
    (["--threshold", "nan"], ("--threshold must be a fraction",)),
    (["--partition", "gpu"], ("--partition needs --slurm",)),
    (["--nodes", "2"], ("--nodes needs --slurm",)),
    (["--gpus", "0"], ("--gpus must be an integer >= 1",)),
    (["--topology", "no-such-machine"], ("topology 'no-such-machine' not found",)),
    (["--", "x"], ("dlaunch doctor takes no arguments after `--`",)),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path: Path, argv, needles):
    done = run_dlaunch("doctor", *argv, cwd=tmp_path, env={"CUDA_VISIBLE_DEVICES": ""})
    assert_one_line_error(done, *needles)
    assert list(tmp_path.iterdir()) == []


def test_a_topology_of_the_other_device_is_refused_before_anything_runs(tmp_path: Path):
    other = "h100-sxm-8x" if count_gpus() == 0 else "cpu-local"
    done = run_dlaunch("doctor", "--topology", other, cwd=tmp_path)
    assert_one_line_error(done, f"--topology {other} describes")
    assert list(tmp_path.iterdir()) == []

"""`dlaunch lab`: the three run specs, the precision choice, the table and its reading.

The runs themselves are faked here (a real lab is three torchrun jobs, one compiled: minutes on
a small CPU host); `dlaunch lab workloads/gpt.py --gpus 2` is the end-to-end check (docs/benchmarks.md).
"""

import dataclasses
import io
import json

from launcher.drivers.lab import LabRow, cpu_precisions, cuda_precisions, format_lab, lab_specs, reading, run_lab
from launcher.results.types import RankResult, RunResult
from launcher.rundir import RunPaths
from launcher.runspec import LaunchSpec

from tests.helpers import REPO, assert_one_line_error


def base_spec(tmp_path) -> LaunchSpec:
    return LaunchSpec(workload=str(REPO / "workloads" / "gpt.py"), run_id="lab-x", run_dir=str(tmp_path),
                      gpus=2, steps=6, micro_batch=4, seed=3,
                      strategy="ddp", precision="bf16")


def fake_result(spec: LaunchSpec, samples_per_s: float, *, status: str = "ok",
                data_wait: float = 0.02) -> RunResult:
    rank = RankResult(rank=0, local_rank=0, node_rank=0, host="h", status=status, steps=spec.steps,
                      steady_steps=spec.steps - spec.warmup_steps, samples_per_s=samples_per_s / 2,
                      units_per_s=samples_per_s * 64, step_time_median_s=8 / samples_per_s,
                      step_time_p90_s=0.1, step_time_max_s=0.1, data_wait_share=data_wait,
                      peak_mem_bytes=2**30, final_loss=4.5,
                      compiled_graphs=4 if spec.compile else None,
                      graph_breaks=0 if spec.compile else None,
                      recompiles=0 if spec.compile else None)
    return RunResult(run_id=spec.run_id, run_dir=spec.run_dir, workload=spec.workload, world_size=2,
                     num_nodes=1, device="cpu", strategy="ddp", precision=spec.precision,
                     status=status, exit_code=0 if status == "ok" else 1, wall_time_s=5.0,
                     samples_per_s=samples_per_s, units_per_s=samples_per_s * 128, sample_units="tokens",
                     step_time_median_s=8 / samples_per_s, slowest_rank=0, data_wait_share=data_wait,
                     ranks=(rank,), verdict={"name": "compute bound", "evidence": "compute is 95%"})


def test_three_specs_differ_only_in_precision_and_compile(tmp_path):
    base = base_spec(tmp_path)
    specs = lab_specs(base, "bf16")
    assert [name for name, _ in specs] == ["fp32", "bf16", "bf16+compile"]
    assert [(s.precision, s.compile) for _, s in specs] == [
        ("fp32", False), ("bf16", False), ("bf16", True)]
    for _, s in specs:
        same = dataclasses.replace(s, run_id=base.run_id, run_dir=base.run_dir, precision=base.precision,
                                   compile=base.compile)
        assert same == base  # same seed, steps, batch: the same fixed data slice
    assert len({s.run_dir for _, s in specs}) == 3


def test_linear_units_are_refused_before_anything_starts(tmp_path):
    import pytest

    from launcher.errors import UsageError

    base = dataclasses.replace(base_spec(tmp_path), strategy="fsdp_full", fsdp_unit="linear")
    with pytest.raises(UsageError, match="third run compiles, which `fsdp_unit` linear does not"):
        lab_specs(base, "bf16")


def test_cpu_precisions_follow_the_bf16_unit():
    with_unit = cpu_precisions({"avx512f", "avx512_bf16"}, "bf16")
    assert with_unit.mixed == "bf16" and with_unit.usable == ("fp32", "bf16")
    assert "avx512_bf16" in with_unit.note
    without = cpu_precisions({"avx2", "fma"}, "fp32")
    assert without.mixed == "bf16" and without.usable == ("fp32",) and "no bf16 unit" in without.note
    assert cuda_precisions((7, 0)).mixed == "fp16" and cuda_precisions((9, 0)).mixed == "bf16"


def test_where_the_plan_keeps_fp32_the_compiled_row_is_fp32(tmp_path):
    # a CPU without a bf16 unit: the plan trains in fp32, so compile's gain is measured there
    # (compiling emulated bf16 answers a question nobody asked)
    precisions = cpu_precisions({"avx2", "fma"}, "fp32")
    assert precisions.compile_precision == "fp32" and "compiled row runs the plan's fp32" in precisions.note
    speeds = iter([100.0, 60.0, 126.0])  # bf16 emulated: slower; fp32 + compile: +26%
    seen = []

    def run(spec, *, out):
        seen.append((spec.precision, spec.compile))
        return fake_result(spec, next(speeds))

    lab = run_lab(base_spec(tmp_path), precisions, run=run, progress=io.StringIO())
    assert seen == [("fp32", False), ("bf16", False), ("fp32", True)]
    assert [r.name for r in lab.rows] == ["fp32", "bf16", "fp32+compile"]
    assert round(lab.compile_speedup, 2) == 1.26  # against the fp32 row, not the bf16 one
    row = next(line for line in format_lab(lab).splitlines() if line.startswith("fp32+compile "))
    assert "1.26x" in row
    assert cpu_precisions({"avx512_bf16"}, "bf16").compile_precision == "bf16"


def test_run_lab_table_speedups_and_reading(tmp_path):
    speeds = iter([100.0, 110.0, 112.0])  # +10% from bf16, +2% from compile

    def run(spec, *, out):
        out.write("rank output that only a failed run shows\n")
        return fake_result(spec, next(speeds))

    progress = io.StringIO()
    lab = run_lab(base_spec(tmp_path), cpu_precisions({"avx512_bf16"}), run=run, progress=progress)
    assert lab.ok and round(lab.precision_speedup, 2) == 1.10 and round(lab.compile_speedup, 3) == 1.018
    text = format_lab(lab)
    rows = [line for line in text.splitlines() if line.startswith(("fp32 ", "bf16 ", "bf16+compile "))]
    assert len(rows) == 3 and "1.00x" in rows[0] and "1.10x" in rows[1] and "1.02x" in rows[2]
    assert "4 graph(s), 0 break(s)" in rows[2]
    assert "not bound by arithmetic" in text and "already large or fused" in text
    assert "bottleneck (bf16 run): compute bound" in text
    assert "rank output" not in progress.getvalue()
    on_disk = json.loads(RunPaths(root=tmp_path).lab.read_text())
    assert [r["name"] for r in on_disk["rows"]] == ["fp32", "bf16", "bf16+compile"]


def test_run_lab_stops_at_a_failed_run_and_shows_its_output(tmp_path):
    def run(spec, *, out):
        out.write("rank 0 failed: boom\n")
        return fake_result(spec, 100.0, status="failed")

    progress = io.StringIO()
    lab = run_lab(base_spec(tmp_path), cpu_precisions({"avx512_bf16"}), run=run, progress=progress)
    assert not lab.ok and len(lab.rows) == 1 and lab.precision_speedup is None
    assert "rank 0 failed: boom" in progress.getvalue()


def test_reading_says_arithmetic_bound_when_precision_pays(tmp_path):
    rows = tuple(LabRow(name=n, precision="bf16", compile=False,
                        result=fake_result(base_spec(tmp_path), 100.0)) for n in ("fp32", "bf16"))
    text = " ".join(reading(rows, 1.6, 1.3))
    assert "arithmetic-bound" in text and "fusing kernels pays" in text


def test_lab_refuses_precision_and_compile_flags(dlaunch):
    done = dlaunch("lab", "workloads/gpt.py", "--precision", "bf16")
    assert_one_line_error(done, "dlaunch lab chooses precision and compile itself", "--precision")


def test_lab_dry_run_prints_three_commands(dlaunch):
    done = dlaunch("lab", "workloads/mlp.py", "--gpus", "2", "--strategy", "ddp", "--micro-batch", "4",
                   "--dry-run")
    assert done.code == 0, done.err
    assert [line for line in done.out.splitlines() if line.startswith("# ")][:1] == ["# fp32"]
    assert done.out.count("torch.distributed.run") == 3


def test_reading_calls_a_slower_mixed_precision_by_its_name(tmp_path):
    rows = tuple(LabRow(name=n, precision="bf16", compile=False,
                        result=fake_result(base_spec(tmp_path), 100.0)) for n in ("fp32", "bf16"))
    text = " ".join(reading(rows, 0.8, None))
    assert "mixed precision was 20% slower than fp32" in text and "repeat the lab" in text


def test_a_compiled_run_still_compiling_after_its_warm_up_is_said_to_understate_its_gain(tmp_path):
    base = base_spec(tmp_path)
    rows = [LabRow(name=name, precision=spec.precision, compile=spec.compile, result=fake_result(spec, speed))
            for (name, spec), speed in zip(lab_specs(base, "bf16"), (100.0, 150.0, 140.0))]
    warm = "most likely a compile after the warm-up"
    assert not any(warm in line for line in reading(tuple(rows), 1.5, 140 / 150))
    rank = rows[2].result.ranks[0]
    ranks = (dataclasses.replace(rank, step_time_max_s=4 * rank.step_time_median_s),)
    rows[2] = dataclasses.replace(rows[2], result=dataclasses.replace(rows[2].result, ranks=ranks))
    said = [line for line in reading(tuple(rows), 1.5, 140 / 150) if warm in line]
    assert said == ["the compiled run's slowest measured step took 4.0x its median (most likely a compile after the "
                    "warm-up): its gain may be understated; rerun with more --warmup-steps"]

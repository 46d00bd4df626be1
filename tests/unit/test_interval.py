"""The 80% interval on every predicted step time: which validation it rests on, and that the
plan, the run summary, the report and a tune's table show it (launcher/plan/interval.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.drivers.tune import Trial, finish, trial_planned, trial_spec
from launcher.errors import PlanError
from launcher.hardware.topology import load_topology
from launcher.plan import interval
from launcher.plan.interval import (
    CPU_RESIDUALS,
    GPU_FALLBACK,
    GPU_RESIDUALS,
    MAX_PUBLISHED_GPUS,
    MIN_BAND_ROWS,
    Residuals,
    seq_band,
    step_interval,
)
from launcher.plan.planfile import write_plan
from launcher.plan.resolve import Planned
from launcher.plan.search import plan
from launcher.plan.types import StepInterval
from launcher.plan.view import format_plan
from launcher.report.tune import cells, read_tune
from launcher.results.prediction import compare, prediction_cell, prediction_line
from launcher.rundir import RunPaths
from launcher.runspec import LaunchSpec
from launcher.specs import Goal, ModelProfile


def test_bands_follow_the_published_sequence_lengths():
    assert [seq_band(s) for s in (None, 512, 1024, 2048, 4096, 8192, 16384, 65536)] == [
        "other", "<=1k", "<=1k", "2k-4k", "2k-4k", "8k", "16k+", "16k+"]


def test_each_regime_takes_its_own_validation():
    cpu = step_interval(0.5, on_gpu=False, seq_len=128)
    assert (cpu.low_s, cpu.high_s) == pytest.approx((0.5 * CPU_RESIDUALS.low_ratio, 0.5 * CPU_RESIDUALS.high_ratio))
    assert cpu.basis == CPU_RESIDUALS.basis and cpu.coverage == 0.8
    for band, res in GPU_RESIDUALS.items():
        seq = {"<=1k": 1024, "2k-4k": 2048, "8k": 8192, "16k+": 32768}[band]
        got = step_interval(1.0, on_gpu=True, seq_len=seq)
        want = res if res.rows >= MIN_BAND_ROWS else GPU_FALLBACK
        assert (got.low_s, got.high_s, got.basis) == pytest.approx((want.low_ratio, want.high_ratio, want.basis))
    # not a sequence model: every published row's spread
    assert step_interval(1.0, on_gpu=True, seq_len=None).basis == GPU_FALLBACK.basis


def test_beyond_the_published_scale_the_interval_widens_and_says_it_is_assumed():
    inside = step_interval(1.0, on_gpu=True, seq_len=2048, world_size=MAX_PUBLISHED_GPUS)
    beyond = step_interval(1.0, on_gpu=True, seq_len=2048, world_size=4 * MAX_PUBLISHED_GPUS)
    assert beyond.low_s < inside.low_s and beyond.high_s > inside.high_s
    assert "assumed" in beyond.basis and "assumed" not in inside.basis
    huge = step_interval(1.0, on_gpu=True, seq_len=2048, world_size=2**40)
    assert huge.low_s > 0


def test_bad_values_are_refused():
    with pytest.raises(PlanError):
        step_interval(0.0, on_gpu=False, seq_len=None)
    with pytest.raises(PlanError):
        step_interval(float("nan"), on_gpu=False, seq_len=None)
    with pytest.raises(PlanError):
        Residuals(low_ratio=1.2, high_ratio=0.9, rows=3, basis="x")
    with pytest.raises(PlanError):
        StepInterval(step_time_s=1.0, low_s=1.1, high_s=0.9, coverage=0.8, basis="x")


def test_around_keeps_the_regimes_ratios():
    base = step_interval(2.0, on_gpu=False, seq_len=None)
    other = base.around(1.0)
    assert (other.low_s, other.high_s) == pytest.approx((base.low_s / 2, base.high_s / 2))
    low, high = other.rate_bounds(100.0)
    assert low == pytest.approx(100 / CPU_RESIDUALS.high_ratio) and high == pytest.approx(100 / CPU_RESIDUALS.low_ratio)


def _profile() -> ModelProfile:
    return ModelProfile(name="m", num_params=10**8, bytes_by_dtype={"float32": 4 * 10**8}, num_blocks=8,
                        largest_block_params=10**7, activation_bytes_per_sample=5e7,
                        block_input_bytes_per_sample=1e6, flops_fwd_per_sample=2e11, units_per_sample=2048,
                        sample_units="tokens")


@pytest.fixture(scope="module")
def planned() -> Planned:
    topo = load_topology("h100-sxm-8x").with_shape(num_nodes=1, devices_per_node=2)
    return Planned(plan=plan(_profile(), topo, Goal()), profile=_profile(), topology=topo)


def test_the_plan_carries_its_interval_into_its_text_and_json(planned: Planned, tmp_path: Path):
    p = planned.plan
    assert p.step_interval is not None and p.step_interval.step_time_s == p.chosen.time.step_time_s
    # the synthetic profile names no kernel source: each is assumed, and the basis says so
    assert p.step_interval.basis.startswith(GPU_RESIDUALS["2k-4k"].basis + "; widened for what was assumed: ")
    text = format_plan(p, planned.profile, planned.topology)
    assert f"({p.step_interval.label()})" in text and p.step_interval.basis in text
    write_plan(tmp_path, planned)
    written = json.loads(RunPaths(root=tmp_path).plan.read_text())["plan"]["step_interval"]
    assert written["low_s"] == pytest.approx(p.step_interval.low_s)


def test_the_summary_and_report_say_whether_the_measurement_fell_inside(planned: Planned, tmp_path: Path):
    write_plan(tmp_path, planned)
    plan_json = json.loads(RunPaths(root=tmp_path).plan.read_text())
    c, span = planned.plan.chosen, planned.plan.step_interval
    assert span is not None
    spec = trial_spec(LaunchSpec(workload="w.py", run_id="t", run_dir=str(tmp_path), device="cuda",
                                 gpus=2), c, 2)
    inside = compare(plan_json, spec, step_time_s=span.step_time_s, peak_mem_bytes=None, device="cuda")
    outside = compare(plan_json, spec, step_time_s=2 * span.high_s, peak_mem_bytes=None, device="cuda")
    assert inside["inside_interval"] is True and outside["inside_interval"] is False
    label = f"({span.low_s:.3g}-{span.high_s:.3g} s, 80%)"
    assert label in prediction_line(inside) and "inside the interval" in prediction_line(inside)
    assert "OUTSIDE the interval" in prediction_line(outside) and label in prediction_cell(outside)
    # a plan.json from before intervals: no interval, nothing made up
    del plan_json["plan"]["step_interval"]
    old = compare(plan_json, spec, step_time_s=0.1, peak_mem_bytes=None, device="cuda")
    assert old["inside_interval"] is None and "80%" not in prediction_line(old)


def test_a_tunes_table_shows_each_trials_interval(planned: Planned, tmp_path: Path):
    c = planned.plan.chosen
    base = LaunchSpec(workload="w.py", run_id="t", run_dir=str(tmp_path), device="cuda", gpus=2)
    trial = Trial(name="DDP bf16", candidate=c, run_dir=str(tmp_path / "1-ddp"), status="ok",
                  measured_step_s=c.time.step_time_s, measured_samples_per_s=1.0)
    finish(base, [trial], workload="w.py", workload_args=[], interval=planned.plan.step_interval)
    summary, _ = read_tune(tmp_path)
    assert summary is not None
    span = planned.plan.step_interval
    assert span is not None
    assert cells(summary.trials[0])[2] == f"{c.time.step_time_s:.3g} s ({span.low_s:.3g}-{span.high_s:.3g})"
    # each trial's own plan.json carries the interval around its own prediction
    other = trial_planned(planned, c).plan.step_interval
    assert other is not None and other.step_time_s == c.time.step_time_s


def test_the_module_is_pure():
    assert "torch" not in interval.__dict__

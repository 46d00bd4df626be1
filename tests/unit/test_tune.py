"""`dlaunch tune`'s pure parts: which candidates are tried, how trials (failed ones too) are
recorded, the plan file `run --plan` reads, and the per-machine correction of the plan."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from launcher.errors import UsageError
from launcher.jobs.tune import UNCERTAINTY, finish, read_plan_file, run_trials, select_trials
from launcher.plan.corrections import (
    MAX_TRIALS_PER_PRECISION,
    TrialRecord,
    correct_plan,
    correction_of,
    load_trials,
    store_trials,
)
from launcher.plan.types import Candidate, MemoryEstimate, Plan, StepTimeEstimate
from launcher.specs import LaunchSpec, Strategy

from tests.helpers import REPO, assert_one_line_error, run_dlaunch


def cand(kind: str = "ddp", precision: str = "fp32", step_s: float = 0.01, *, fits: bool = True,
         ckpt: bool = False, mb: int = 8, comm_s: float = 0.0) -> Candidate:
    mem = MemoryEstimate(params_bytes=1, grads_bytes=1, optimizer_bytes=1, activations_bytes=1, overhead_bytes=0)
    return Candidate(strategy=Strategy(kind=kind, precision=precision, activation_checkpointing=ckpt),
                     micro_batch=mb, grad_accum_steps=1, memory=mem, fits=fits,
                     time=StepTimeEstimate(compute_s=step_s - comm_s, comm_total_s=comm_s, comm_exposed_s=comm_s))


def plan_of(chosen: Candidate, *rejected: Candidate) -> Plan:
    return Plan(chosen=chosen, world_size=2, num_nodes=1, global_batch=16, units_per_s=16 / chosen.time.step_time_s,
                scaling_efficiency=1.0, env={}, reasons=("why",), rejected=rejected, usable_mem_bytes=1e9)


def test_trials_are_the_fitting_candidates_within_the_uncertainty_at_most_k():
    best = cand(step_s=0.010)
    near = cand(precision="bf16", step_s=0.010 * (1 + UNCERTAINTY["cpu"]) * 0.99)
    ckpt = cand(ckpt=True, step_s=0.011)
    far = cand("fsdp_full", step_s=0.010 * (1 + UNCERTAINTY["cpu"]) * 1.01)
    too_big = cand("fsdp_grad_op", step_s=0.001, fits=False)
    plan = plan_of(best, too_big, ckpt, near, far)
    assert select_trials(plan, "cpu", 4) == [best, ckpt, near]
    assert select_trials(plan, "cpu", 2) == [best, ckpt]
    # per sample: a larger micro-batch with a longer step can be the faster candidate
    big = cand(mb=16, step_s=0.018)
    assert select_trials(plan_of(best, big), "cuda", 4) == [best, big]
    assert select_trials(plan_of(best, cand(step_s=0.0116)), "cuda", 4) == [best]


def _base(tmp_path: Path) -> LaunchSpec:
    return LaunchSpec(workload=str(REPO / "workloads" / "mlp.py"), run_id="tune-x", run_dir=str(tmp_path),
                      nproc_per_node=2, steps=6)


def test_a_failed_trial_is_recorded_and_the_fastest_measured_wins(tmp_path: Path):
    fast, crash, slow = cand(step_s=0.01), cand(ckpt=True, step_s=0.011), cand(precision="bf16", step_s=0.012)
    seen = []

    def run(spec: LaunchSpec, out) -> SimpleNamespace:
        seen.append(spec)
        if spec.strategy.activation_checkpointing:
            return SimpleNamespace(status="failed", failures=("rank 0: RuntimeError: boom",), exit_code=1,
                                   samples_per_s=0.0, step_time_median_s=0.0)
        rate = 500.0 if spec.strategy.precision == "bf16" else 400.0  # the model ranked bf16 last
        return SimpleNamespace(status="ok", failures=(), exit_code=0, samples_per_s=rate,
                               step_time_median_s=16 / rate)

    progress = io.StringIO()
    trials = run_trials(_base(tmp_path), [fast, crash, slow], run=run, progress=progress)
    assert [t.status for t in trials] == ["ok", "failed", "ok"] and "boom" in trials[1].reason
    assert all(not s.calibrate_comm and Path(s.run_dir).parent == tmp_path for s in seen)
    assert "[3/3]" in progress.getvalue() and "best so far: DDP bf16" in progress.getvalue()
    tune = finish(_base(tmp_path), trials, workload="w.py", workload_args=())
    assert tune.best is trials[2]
    assert read_plan_file(tune.tuned_plan)["precision"] == "bf16"
    assert json.loads((tmp_path / "tune.json").read_text())["chosen"] == trials[2].name


def test_the_budget_stops_further_trials_but_never_the_first(tmp_path: Path):
    ok = SimpleNamespace(status="ok", failures=(), exit_code=0, samples_per_s=100.0, step_time_median_s=0.16)
    trials = run_trials(_base(tmp_path), [cand(), cand(ckpt=True)], budget_s=0.0, run=lambda spec, out: ok,
                        progress=io.StringIO())
    assert [t.status for t in trials] == ["ok", "skipped"] and "--budget-min" in trials[1].reason


def test_plan_files_tuned_or_from_a_run_dir_and_bad_ones(tmp_path: Path):
    run_plan = tmp_path / "plan.json"
    run_plan.write_text(json.dumps({"plan": plan_of(cand("fsdp_full", ckpt=True)).to_dict()}))
    assert read_plan_file(str(run_plan)) == {"strategy": "fsdp_full", "precision": "fp32", "micro_batch": 8,
                                             "grad_accum": 1, "checkpointing": True, "compile": False}
    bad = tmp_path / "bad.json"
    bad.write_text('{"decisions": {"strategy": "ddp"}}')
    with pytest.raises(UsageError, match="no precision, micro_batch"):
        read_plan_file(str(bad))
    with pytest.raises(UsageError, match="not a readable JSON plan file"):
        read_plan_file(str(tmp_path / "missing.json"))


def record(precision: str, ratio: float, at: str = "2025-01-02T00:00:00") -> TrialRecord:
    return TrialRecord(precision=precision, compute_ratio=ratio, step_ratio=ratio, predicted_step_s=0.01,
                       measured_step_s=0.01 * ratio, workload="mlp.py", tune_dir="runs/t", at=at)


def test_corrections_are_stored_trimmed_and_reduced_to_medians(tmp_path: Path):
    path = tmp_path / "c.json"
    store_trials(path, [record("fp32", 2.0), record("fp32", 4.0), record("fp32", 3.0)])
    store_trials(path, [record("bf16", 1.0, "2025-02-03T00:00:00")])
    correction = correction_of(load_trials(path))
    assert correction is not None and correction.factors == {"fp32": 3.0, "bf16": 1.0}
    assert correction.overall == 2.5 and correction.factor("fp16") == 2.5
    assert correction.describe().startswith("corrected by 4 tune trials (2025-02-03)")
    store_trials(path, [record("fp32", 1.0)] * (MAX_TRIALS_PER_PRECISION + 5))
    assert len([t for t in load_trials(path) if t.precision == "fp32"]) == MAX_TRIALS_PER_PRECISION
    path.write_text('{"format": 0, "trials": []}')
    assert load_trials(path) == [] and correction_of([]) is None


def test_correct_plan_scales_compute_and_may_switch_the_choice():
    fp32, bf16 = cand(step_s=0.010, comm_s=0.002), cand(precision="bf16", step_s=0.011, comm_s=0.002)
    correction = correction_of([record("fp32", 2.0), record("bf16", 1.0)])
    fixed = correct_plan(plan_of(fp32, bf16), correction)
    assert fixed.chosen.strategy.precision == "bf16"  # 0.011 s against 0.008 x 2 + 0.002
    assert fixed.chosen.time.step_time_s == pytest.approx(0.011)
    assert [c.time.step_time_s for c in fixed.rejected] == pytest.approx([0.018])
    assert fixed.reasons[1].startswith("corrected by 2 tune trials")
    kept = correct_plan(plan_of(fp32, bf16), correction, may_switch=False)
    assert kept.chosen.strategy.precision == "fp32" and kept.chosen.time.compute_s == pytest.approx(0.016)
    assert dataclasses.replace(kept, reasons=()).units_per_s == pytest.approx(16 / 0.018)


def test_tune_slurm_is_refused_in_one_line():
    assert_one_line_error(run_dlaunch("tune", str(REPO / "workloads" / "mlp.py"), "--slurm"),
                          "tune --slurm: not available yet (run tune on one node of the partition)")

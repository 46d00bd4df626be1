"""`dlaunch tune`'s pure parts: which candidates are tried, how trials (failed ones too) are
recorded, each trial's plan.json and console, a refused first trial, the plan file `run --plan`
reads, the per-machine correction of the plan, two tunes at once (the lock, neither stores its
trials); and `tune --dry-run` (local and SLURM)."""

from __future__ import annotations

import dataclasses
import io
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from launcher.cli.main import main
from launcher.cli.tune import tune_lock
from launcher.drivers.tune import (
    MAX_TRIAL_STEPS,
    TRIAL_STEPS,
    TRIAL_TIMED_S,
    UNCERTAINTY,
    Refused,
    decisions_of,
    discard,
    finish,
    read_plan_file,
    run_trials,
    select_trials,
    trial_steps,
)
from launcher.errors import UsageError
from launcher.plan.corrections import (
    MAX_TRIALS_PER_PRECISION,
    TrialRecord,
    TuneLock,
    correction_of,
    load_trials,
    store_trials,
)
from launcher.plan.search import plan
from launcher.plan.types import Candidate, MemoryEstimate, Plan, StepTimeEstimate
from launcher.rundir import RunPaths, create_run_dir
from launcher.runspec import LaunchSpec
from launcher.specs import Goal, Strategy

from tests.helpers import REPO, assert_one_line_error, run_dlaunch, seeded_cache
from tests.unit import test_planner as planner


def cand(kind: str = "ddp", precision: str = "fp32", step_s: float = 0.01, *, fits: bool = True,
         ckpt: bool = False, mb: int = 8, comm_s: float = 0.0) -> Candidate:
    mem = MemoryEstimate(params_bytes=1, grads_bytes=1, optimizer_bytes=1, activations_bytes=1, overhead_bytes=0)
    return Candidate(strategy=Strategy(kind=kind, precision=precision, checkpointing="full" if ckpt else "none"),
                     micro_batch=mb, grad_accum=1, memory=mem, fits=fits,
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


def test_trials_without_steps_time_enough_of_the_fastest_candidates_steps():
    # slow steps: the floor; 10 ms steps: the timed part fills TRIAL_TIMED_S after the warm-up
    assert trial_steps([cand(step_s=0.5), cand(step_s=0.4)], None) == TRIAL_STEPS
    fast = trial_steps([cand(step_s=0.02), cand(step_s=0.01)], None)
    assert fast == 3 + round(TRIAL_TIMED_S / 0.01) and fast * 0.01 >= TRIAL_TIMED_S
    assert trial_steps([cand(step_s=0.01)], 10) == fast + 7
    assert trial_steps([cand(step_s=1e-6)], None) == MAX_TRIAL_STEPS


def _base(tmp_path: Path) -> LaunchSpec:
    return LaunchSpec(workload=str(REPO / "workloads" / "mlp.py"), run_id="tune-x", run_dir=str(tmp_path),
                      gpus=2, steps=6)


def test_a_failed_trial_is_recorded_and_the_fastest_measured_wins(tmp_path: Path):
    fast, crash, slow = cand(step_s=0.01), cand(ckpt=True, step_s=0.011), cand(precision="bf16", step_s=0.012)
    seen = []

    def run(spec: LaunchSpec, out) -> SimpleNamespace:
        seen.append(spec)
        if spec.parallel.recomputes:
            return SimpleNamespace(status="failed", failures=("rank 0: RuntimeError: boom",), exit_code=1,
                                   samples_per_s=0.0, step_time_median_s=0.0)
        rate = 500.0 if spec.precision == "bf16" else 400.0  # the model ranked bf16 last
        return SimpleNamespace(status="ok", failures=(), exit_code=0, samples_per_s=rate,
                               step_time_median_s=16 / rate)

    progress = io.StringIO()
    trials = run_trials(_base(tmp_path), [fast, crash, slow], run=run, progress=progress)
    assert [t.status for t in trials] == ["ok", "failed", "ok"] and "boom" in trials[1].reason
    assert all(not s.calibrate and Path(s.run_dir).parent == tmp_path for s in seen)
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
                                             "grad_accum": 1, "checkpointing": "full", "compile": False, "tp": 1,
                                             "reduce_dtype": "fp32", "fsdp_unit": "block"}
    # the reduce dtype and FSDP's unit a plan was made with are decisions a run following it repeats
    bf16 = cand("fsdp_full", "bf16")
    bf16 = dataclasses.replace(bf16, strategy=dataclasses.replace(bf16.strategy, reduce_dtype="bf16",
                                                                  fsdp_unit="linear"))
    run_plan.write_text(json.dumps({"plan": plan_of(bf16).to_dict()}))
    assert [read_plan_file(str(run_plan))[k] for k in ("reduce_dtype", "fsdp_unit")] == ["bf16", "linear"]
    assert [decisions_of(bf16)[k] for k in ("reduce_dtype", "fsdp_unit")] == ["bf16", "linear"]
    # the kernels the plan was told travel with it (a run following it prices them again); the
    # ones it detected or defaulted to do not: the run finds them again
    told = plan_of(cand("fsdp_full", ckpt=True)).to_dict()
    told["kernels"] = {"attention": {"kernel": "fa2", "source": "given"},
                       "loss": {"kernel": "eager", "source": "detected"}}
    run_plan.write_text(json.dumps({"plan": told}))
    decided = read_plan_file(str(run_plan))
    assert decided["attention_kernel"] == "fa2" and "loss_kernel" not in decided
    bad = tmp_path / "bad.json"
    bad.write_text('{"decisions": {"strategy": "ddp"}}')
    with pytest.raises(UsageError, match="no precision, micro_batch"):
        read_plan_file(str(bad))
    with pytest.raises(UsageError, match="not a readable JSON plan file"):
        read_plan_file(str(tmp_path / "missing.json"))


def record(precision: str, ratio: float, at: str = "2025-01-02T00:00:00", *, workload: str = "mlp.py",
           args: tuple[str, ...] = ()) -> TrialRecord:
    return TrialRecord(precision=precision, compute_ratio=ratio, step_ratio=ratio, predicted_step_s=0.01,
                       measured_step_s=0.01 * ratio, workload=workload, workload_args=args,
                       tune_dir="runs/t", at=at)


def test_corrections_are_stored_trimmed_and_reduced_to_medians(tmp_path: Path):
    path = tmp_path / "c.json"
    store_trials(path, [record("fp32", 1.2), record("fp32", 1.8), record("fp32", 1.5)])
    store_trials(path, [record("bf16", 1.0, "2025-02-03T00:00:00")])
    correction = correction_of(load_trials(path))
    assert correction is not None and correction.factors == {"fp32": 1.5, "bf16": 1.0}
    assert correction.overall == 1.35 and correction.factor("fp16") == 1.35
    assert correction.describe().startswith("corrected by 4 tune trials (2025-02-03)")
    store_trials(path, [record("fp32", 1.0)] * (MAX_TRIALS_PER_PRECISION + 5))
    assert len([t for t in load_trials(path) if t.precision == "fp32"]) == MAX_TRIALS_PER_PRECISION
    path.write_text('{"format": 0, "trials": []}')
    assert load_trials(path) == [] and correction_of([]) is None


def test_a_trial_far_off_the_prediction_is_not_learnt(tmp_path: Path, caplog):
    # 0.31: a probe cached while the host was busy, measured against an idle tune
    path = tmp_path / "c.json"
    refused = store_trials(path, [record("fp32", 0.31), record("fp32", 1.1)])
    assert [t.step_ratio for t in refused] == [0.31]
    assert [t.step_ratio for t in load_trials(path)] == [1.1]
    assert "measured/predicted 0.31 is outside 0.5-2" in caplog.text


def test_a_tune_of_one_workload_leaves_another_workloads_plan_alone(tmp_path: Path):
    path = tmp_path / "c.json"
    store_trials(path, [record("fp32", 1.8, workload="mlp.py"),
                        record("fp32", 0.6, workload="gpt.py", args=("--size", "small"))])
    trials = load_trials(path)
    assert correction_of(trials, workload="resnet.py") is None
    assert correction_of(trials, workload="gpt.py") is None  # other arguments: another model
    gpt = correction_of(trials, workload="gpt.py", workload_args=["--size", "small"])
    mlp = correction_of(trials, workload="mlp.py")
    assert gpt is not None and gpt.factor("fp32") == 0.6
    assert mlp is not None and mlp.factor("fp32") == 1.8


def test_a_correction_is_applied_before_the_choice_so_every_number_agrees():
    # the plan's header, its reasons and its candidates come from one corrected estimate (a
    # corrected plan once printed 30,505 tokens/s in its header and 11,171 in its reasons)
    topo, goal = planner.topology("h100-sxm-8x"), Goal(global_batch=64)
    base = plan(planner.GPT_125M, topo, goal)
    note = "corrected by 2 tune trials (2025-02-03): predicted compute x3 for bf16"
    fixed = plan(planner.GPT_125M, topo, goal, compute_factor=lambda p: 3.0 if p == "bf16" else 1.0,
                 correction_note=note)
    assert fixed.reasons[1] == note
    old_t, new_t = base.chosen.time, fixed.chosen.time
    assert new_t.compute_s == pytest.approx(3 * old_t.compute_s)
    assert fixed.units_per_s * new_t.step_time_s == pytest.approx(base.units_per_s * old_t.step_time_s)
    text = " ".join(fixed.reasons)
    shown = {float(x) for x in re.findall(r"([\d.]+) s/step", text)}
    assert f"{new_t.step_time_s:.3g}" in {f"{x:.3g}" for x in shown} or not shown
    assert f"{old_t.step_time_s:.3g}" not in text  # the compile reason's eager step too


def test_each_trial_gets_its_plan_and_console_before_it_runs(tmp_path: Path):
    seen = {}

    def run(spec: LaunchSpec, out) -> SimpleNamespace:
        seen[spec.run_dir] = json.loads(RunPaths(root=spec.run_dir).plan.read_text())
        out.write(f"trained {spec.precision}\n")
        return SimpleNamespace(status="ok", failures=(), exit_code=0, samples_per_s=100.0, step_time_median_s=0.16)

    def keep_plan(spec: LaunchSpec, c: Candidate) -> None:
        RunPaths(root=spec.run_dir).plan.write_text(json.dumps({"precision": c.strategy.precision}))

    trials = run_trials(_base(tmp_path), [cand(), cand(precision="bf16")], run=run, keep_plan=keep_plan,
                        progress=io.StringIO())
    assert [seen[t.run_dir]["precision"] for t in trials] == ["fp32", "bf16"]
    assert [RunPaths(root=t.run_dir).console_log.read_text() for t in trials] == ["trained fp32\n", "trained bf16\n"]


def test_a_refused_first_trial_stops_the_tune_and_leaves_nothing(tmp_path: Path):
    tune_dir = tmp_path / "t"
    create_run_dir(tune_dir, "tune-x")

    def refused(spec: LaunchSpec, out) -> SimpleNamespace:
        raise Refused("SLURM refused the job: unknown partition 'nope'")

    with pytest.raises(Refused, match="unknown partition"):
        run_trials(_base(tune_dir), [cand(), cand(ckpt=True)], run=refused, progress=io.StringIO(),
                   keep_plan=lambda spec, c: RunPaths(root=spec.run_dir).plan.write_text("{}"))
    (tune_dir / "mine.txt").write_text("not dlaunch's")
    discard(str(tune_dir))
    assert sorted(p.name for p in tune_dir.iterdir()) == ["mine.txt"]  # only what the tune wrote went
    (tune_dir / "mine.txt").unlink()
    discard(str(tune_dir))
    assert not tune_dir.exists()

    # once a trial ran, a refusal is that trial's failure and the tune goes on
    calls = []

    def second_refused(spec: LaunchSpec, out) -> SimpleNamespace:
        calls.append(spec)
        if len(calls) == 2:
            raise Refused("SLURM refused the job: QOSMaxSubmitJobPerUserLimit")
        return SimpleNamespace(status="ok", failures=(), exit_code=0, samples_per_s=100.0, step_time_median_s=0.16)

    trials = run_trials(_base(tmp_path / "u"), [cand(), cand(ckpt=True), cand(precision="bf16")],
                        run=second_refused, progress=io.StringIO())
    assert [t.status for t in trials] == ["ok", "failed", "ok"] and "QOSMax" in trials[1].reason


def test_tune_slurm_needs_the_partitions_topology_and_slurm_flags_need_slurm(tmp_path: Path):
    mlp = str(REPO / "workloads" / "mlp.py")
    assert_one_line_error(run_dlaunch("tune", mlp, "--slurm", "--dry-run", cwd=tmp_path),
                          "dlaunch tune --slurm needs --topology FILE", "partition's nodes")
    assert_one_line_error(run_dlaunch("tune", mlp, "--topology", "cpu-local", cwd=tmp_path),
                          "--topology needs --slurm")
    assert_one_line_error(run_dlaunch("tune", mlp, "--slurm", "--gpus", "2", "--gpus-per-node", "4",
                                      "--dry-run", cwd=tmp_path), "--gpus 2 and --gpus-per-node 4 disagree")


def test_tune_dry_run_prints_every_trials_job_and_starts_nothing(tmp_path: Path):
    env = {"DLAUNCH_CACHE_DIR": str(seeded_cache(tmp_path / "cache"))}
    common = (str(REPO / "workloads" / "mlp.py"), "--trials", "2", "--dry-run", "--tune-dir", str(tmp_path / "t"))
    local = run_dlaunch("tune", *common, "--gpus", "2", cwd=tmp_path, env=env)
    assert local.code == 0, local.err
    assert local.out.startswith("# trial 1 of ") and local.out.count("-m torch.distributed.run") == local.out.count(
        "# trial ") >= 1
    slurm = run_dlaunch("tune", *common, "--slurm", "--nodes", "2", "--gpus", "1", "--topology",
                        str(REPO / "topologies" / "cpu-local.yaml"), cwd=tmp_path, env=env)
    assert slurm.code == 0, slurm.err
    trials = slurm.out.count("# trial ")
    assert trials >= 1 and slurm.out.count("#SBATCH --nodes=2") == trials
    assert slurm.out.count("as its own SLURM job") == trials and "--node-rank 1" in slurm.out
    assert not (tmp_path / "t").exists() and not (tmp_path / "runs").exists()
    # a long warm-up without --steps: the trials grow around it instead of being refused
    long = run_dlaunch("tune", *common, "--gpus", "2", "--warmup-steps", "20", cwd=tmp_path, env=env)
    assert long.code == 0, long.err
    specs = [json.loads(block.split("\n# ", 1)[0]) for block in long.out.split(".json)\n")[1:]]
    assert specs and all(s["warmup_steps"] == 20 and s["steps"] > 20 for s in specs), specs


def test_a_tune_lock_held_elsewhere_contends_both_tunes(tmp_path: Path):
    path = tmp_path / "cache" / "tune.lock"
    with TuneLock(path) as first:
        assert first.held and not first.contended
        with TuneLock(path) as second:  # another open file: flock sees another holder
            assert not second.held and second.contended
        assert first.contended  # the second knocked: the first's trials ran beside it
    with TuneLock(path) as alone:  # released, knocks forgotten: the next tune is alone
        assert alone.held and not alone.contended
    # a holder that dies releases it, however it ends
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'ab'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)",
                               str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with TuneLock(path) as second:
            assert second.contended
    finally:
        holder.kill()
        holder.wait()
    with TuneLock(path) as alone:
        assert alone.held and not alone.contended


def test_a_tune_beside_another_stores_no_trials(tmp_path: Path, monkeypatch, capsys):
    # the real command, planning for real; its trials faked (measured 1.1x the prediction)
    monkeypatch.setenv("DLAUNCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)

    def run(spec: LaunchSpec, out) -> SimpleNamespace:
        predicted = json.loads(RunPaths(root=spec.run_dir).plan.read_text())["plan"]["chosen"]["time"]["compute_s"]
        return SimpleNamespace(status="ok", failures=(), exit_code=0, samples_per_s=100.0,
                               step_time_median_s=1.1 * predicted)

    monkeypatch.setattr("launcher.cli.tune.Runner", lambda **kw: run)
    argv = ["tune", str(REPO / "workloads" / "mlp.py"), "--gpus", "1", "--trials", "1", "--steps", "4",
            "--warmup-steps", "1"]
    with TuneLock(tune_lock().path):  # another tune's trials are running
        assert main([*argv, "--tune-dir", str(tmp_path / "t1")]) == 0
    err = capsys.readouterr().err
    assert "another dlaunch tune is running on this machine: its timings are contended, not stored" in err, err
    assert "stored for this machine" not in err
    assert not list((tmp_path / "cache").glob("corrections/*.json"))
    # alone, the same tune stores its trial
    assert main([*argv, "--tune-dir", str(tmp_path / "t2")]) == 0
    assert "stored for this machine" in capsys.readouterr().err
    assert [len(load_trials(p)) for p in (tmp_path / "cache").glob("corrections/*.json")] == [1]

"""What a run reports about itself, on synthetic rank files: wall-clock throughput and the
prediction (plan.json) set against the measurement, checked against numbers computed by hand."""

from __future__ import annotations

import json
import re

import pytest

from launcher.plan.types import Candidate, MemoryEstimate, Plan, StepTimeEstimate
from launcher.report.html import page
from launcher.report.render import markdown, summary_lines
from launcher.report.scaling import build_report
from launcher.results.aggregate import aggregate, measured_wall_s
from launcher.results.table import format_run
from launcher.rundir import RunPaths
from launcher.specs import GIB, Strategy

from tests.synthetic import write_run


def prediction_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("prediction")]


# --- throughput over wall time -------------------------------------------------------------

def test_throughput_counts_the_time_between_steps(tmp_path):
    # 2 ranks x 8 samples per step; steps of 0.1 s with 0.01 s of bookkeeping between them:
    # every steady step takes 0.11 s of wall time -> 16 / 0.11 = 145.45 samples/s
    # (step time alone would say 16 / 0.1 = 160); units: 4 per sample
    write_run(tmp_path / "r", world_size=2, steps=20, warmup=2, step_s=0.1, gap_s=0.01,
              units_per_sample=4, sample_units="tokens")
    res = aggregate(tmp_path / "r")
    assert res.throughput_basis == "wall clock"
    assert res.samples_per_s == pytest.approx(16 / 0.11)
    assert res.units_per_s == pytest.approx(4 * 16 / 0.11)
    assert res.ranks[0].measured_wall_s == pytest.approx(18 * 0.11)
    assert res.ranks[0].samples_per_s == pytest.approx(8 / 0.11)
    assert res.step_time_median_s == pytest.approx(0.1)  # medians keep the step's own time


def test_a_run_that_ended_in_warm_up_is_measured_without_its_first_step(tmp_path):
    # a plain script of 3 steps under dlaunch's 3 warm-up steps: its first step is timed from the
    # script's start (imports, rendezvous: 5 s here), which is not its throughput
    write_run(tmp_path / "r", world_size=1, steps=4, warmup=3, step_s=0.1)
    path = RunPaths(root=tmp_path / "r").records(0)
    lines = [line for line in path.read_text().splitlines() if '"step":4,' not in line]
    path.write_text("\n".join(lines).replace('"step_time_s":0.1,"loss":1.75', '"step_time_s":5.0,"loss":1.75') + "\n")
    summary = RunPaths(root=tmp_path / "r").summary(0)
    summary.write_text(json.dumps({**json.loads(summary.read_text()), "steps": 3}))
    res = aggregate(tmp_path / "r")
    assert res.ranks[0].steps == 3 and res.ranks[0].steady_steps == 2
    assert res.samples_per_s == pytest.approx(8 / 0.1)


def test_a_killed_rank_got_as_far_as_its_heartbeat_says_past_its_last_flushed_record(tmp_path):
    # SIGKILL loses the records queued since the last flush; the summary dlaunch writes for the
    # rank takes the heartbeat's step (backends.postmortem), which the failure line must keep
    write_run(tmp_path / "r", world_size=2, steps=4, warmup=1)
    paths = RunPaths(root=tmp_path / "r")
    paths.summary(1).write_text(json.dumps({"rank": 1, "status": "killed", "steps": 9, "time": 2.0e9,
                                            "error": "by signal SIGKILL (9)", "written_by": "dlaunch"}))
    res = aggregate(tmp_path / "r")
    assert [r.steps for r in res.ranks] == [4, 9]
    # a summary from before this attempt's start (a requeued job's last attempt) does not set it
    paths.summary(1).write_text(json.dumps({"rank": 1, "status": "killed", "steps": 9, "time": 0.5e9}))
    assert [r.steps for r in aggregate(tmp_path / "r").ranks] == [4, 4]
    assert res.failures == ("rank 1 (host node0, node 0, local rank 1) killed after 9 steps: by signal SIGKILL (9)",)


def test_a_script_that_reported_no_steps_is_told_how_to_show_them_unless_it_failed(tmp_path):
    from launcher.runspec import LaunchSpec

    notes = {}
    for code in (0, 1):
        run = tmp_path / f"r{code}"
        write_run(run, world_size=1, result=None, spec=LaunchSpec(
            workload="train.py", is_script=True, run_id=run.name, run_dir=str(run), gpus=1))
        path = RunPaths(root=run).records(0)
        path.write_text("".join(line + "\n" for line in path.read_text().splitlines() if '"kind":"step"' not in line))
        notes[code] = " ".join(aggregate(run, exit_code=code).unreadable)
    assert "the script reported no steps: no torch optimizer stepped" in notes[0]
    assert "reported no steps" not in notes[1]  # stopped or failed: its failure says why


def test_the_slowest_rank_sets_the_wall_time(tmp_path):
    # rank 1 at 1.5x: 18 steps x 0.15 s; the run's 2 x 8 x 18 samples take that long
    write_run(tmp_path / "r", world_size=2, steps=20, warmup=2, step_s=0.1, slow={1: 1.5})
    res = aggregate(tmp_path / "r")
    assert res.samples_per_s == pytest.approx(2 * 8 * 18 / (18 * 0.15))


def test_rank_files_without_end_times_use_step_times(tmp_path):
    write_run(tmp_path / "r", world_size=2, step_s=0.1, gap_s=0.01)
    for rank in range(2):
        path = RunPaths(root=tmp_path / "r").records(rank)
        path.write_text(re.sub(r'"end_time":[0-9.e+]+,', "", path.read_text()))
    res = aggregate(tmp_path / "r")
    assert res.throughput_basis == "step time"
    assert res.samples_per_s == pytest.approx(2 * 8 / 0.1)
    assert res.ranks[0].measured_wall_s is None


def test_profiled_steps_leave_the_wall_time_with_their_spans():
    # steps end at 1, 2, 3.5, 4.5: step 3 (profiled, 1.5 s) is out; step 1 is warm-up
    steps = [{"end_time": t, "step_time_s": 0.9, "warmup": i == 0, "profiled": i == 2}
             for i, t in enumerate([1.0, 2.0, 3.5, 4.5])]
    steady = [s for s in steps if not s["warmup"] and not s["profiled"]]
    assert measured_wall_s(steps, steady) == pytest.approx(1.0 + 1.0)
    # no warm-up at all: the first step spans its own step time
    assert measured_wall_s(steps[:2], steps[:2]) == pytest.approx(0.9 + 1.0)


# --- predicted against measured --------------------------------------------------------------

def write_plan(run_dir, *, micro_batch=8, world_size=2, compute_s=0.08, exposed_s=0.02,
               params_gib=0.25, grads_gib=0.25):
    """plan.json as `dlaunch run` writes it: Plan.to_dict() of a real plan."""
    chosen = Candidate(
        strategy=Strategy(kind="ddp", precision="fp32"), micro_batch=micro_batch, grad_accum=1,
        memory=MemoryEstimate(params_bytes=params_gib * GIB, grads_bytes=grads_gib * GIB,
                              optimizer_bytes=0.0, activations_bytes=0.0, overhead_bytes=0.0),
        time=StepTimeEstimate(compute_s=compute_s, comm_total_s=exposed_s, comm_exposed_s=exposed_s),
        fits=True)
    plan = Plan(chosen=chosen, world_size=world_size, num_nodes=1, global_batch=micro_batch * world_size,
                units_per_s=160.0, scaling_efficiency=1.0, env={}, reasons=(), rejected=(),
                usable_mem_bytes=GIB)
    RunPaths(root=run_dir).plan.write_text(json.dumps({"plan": plan.to_dict(), "profile": {},
                                                       "topology": "t"}))


def add_live_bytes(run_dir, nbytes: dict[int, int], step: int = 2) -> None:
    """Give rank r's step `step` the live tensor peak the harness samples on CPU."""
    for rank, n in nbytes.items():
        path = RunPaths(root=run_dir).records(rank)
        path.write_text(path.read_text().replace(f'"step":{step},', f'"step":{step},"live_peak_bytes":{n},'))


def test_prediction_against_measured(tmp_path):
    # predicted: 0.08 + 0.02 = 0.1 s and 0.25 + 0.25 = 0.5 GiB per rank;
    # measured: median step 0.125 s, live tensors at most 2**28 B = 0.25 GiB (the RSS, also
    # 2**28 in these files, is never what the plan is compared with) -> ratios 1.25 and 0.5
    run = write_run(tmp_path / "r", world_size=2, step_s=0.125)
    add_live_bytes(run, {0: 1 << 27, 1: 1 << 28})
    write_plan(run)
    res = aggregate(run)
    block = res.prediction
    assert block["available"] and block["source"] == "plan.json"
    assert block["step_time_s"] == pytest.approx(0.1)
    assert block["measured_step_time_s"] == pytest.approx(0.125)
    assert block["step_time_ratio"] == pytest.approx(1.25)
    assert block["mem_gib"] == pytest.approx(0.5)
    assert block["measured_mem_gib"] == pytest.approx(0.25)
    assert block["mem_ratio"] == pytest.approx(0.5)
    assert "live tensor bytes" in block["measured_mem_kind"]  # a CPU run: what was measured, named
    assert prediction_lines(format_run(res)) == [
        "prediction vs measured (plan.json): step time 0.100 s predicted, 0.125 s measured median "
        "(measured/predicted 1.25); memory per rank 0.50 GiB predicted, 0.25 GiB measured as peak "
        "live tensor bytes of a sampled step (runtime.live_bytes), largest rank "
        "(measured/predicted 0.50)"]
    # result.json carries the same block
    assert json.loads(json.dumps(res.to_dict()))["prediction"]["step_time_ratio"] == pytest.approx(1.25)


def test_without_a_plan_no_number_is_made_up(tmp_path):
    res = aggregate(write_run(tmp_path / "r", world_size=2))
    assert res.prediction == {"available": False, "reason": "no plan"}
    assert prediction_lines(format_run(res)) == ["prediction: not available (no plan)"]


def test_a_plan_the_run_did_not_follow_is_not_compared(tmp_path):
    run = write_run(tmp_path / "r", world_size=2)
    write_plan(run, micro_batch=4)
    [line] = prediction_lines(format_run(aggregate(run)))
    assert line == ("prediction: not available (the run did not follow plan.json: micro-batch 4 "
                    "planned, 8 run)")


def test_an_unreadable_plan_is_named(tmp_path):
    run = write_run(tmp_path / "r", world_size=2)
    RunPaths(root=run).plan.write_text("{not json")
    res = aggregate(run)
    assert prediction_lines(format_run(res))[0].startswith("prediction: not available (plan.json: unreadable")
    assert any(n.startswith("plan.json: unreadable") for n in res.unreadable)


def test_the_report_shows_the_prediction_of_each_run(tmp_path):
    run = write_run(tmp_path / "r", world_size=2, step_s=0.125)
    write_plan(run)
    RunPaths(root=run).result.write_text(json.dumps(aggregate(run).to_dict()))
    rep = build_report(run, with_prediction=False)
    point = rep.points[0]
    assert point.prediction["step_time_ratio"] == pytest.approx(1.25)
    line = "r: prediction vs measured (plan.json): step time 0.100 s predicted, 0.125 s measured"
    assert any(x.strip().startswith(line) for x in summary_lines(rep)), summary_lines(rep)
    assert f"- {line}" in markdown(rep)
    assert "step 0.100 s pred., 0.125 s meas. (1.25); mem 0.50 GiB pred., - meas. (-)" in page(rep, [])


def test_the_report_compares_a_result_written_before_the_block(tmp_path):
    run = write_run(tmp_path / "r", world_size=2, step_s=0.125)
    write_plan(run)
    old = aggregate(run).to_dict()
    del old["prediction"]
    RunPaths(root=run).result.write_text(json.dumps(old))
    point = build_report(run, with_prediction=False).points[0]
    assert point.prediction["step_time_ratio"] == pytest.approx(1.25)


# --- the workload's evaluation (--eval-every) ----------------------------------------------

def test_the_last_evaluation_reaches_the_result_and_the_summary(tmp_path):
    write_run(tmp_path / "r", world_size=2, steps=6, warmup=1)
    paths = RunPaths(root=tmp_path / "r")
    for rank in (0, 1):
        summary = json.loads(paths.summary(rank).read_text())
        paths.summary(rank).write_text(json.dumps({**summary, "eval": {"step": 6, "val_loss": 2.5}}))
    res = aggregate(tmp_path / "r")
    assert res.last_eval == {"step": 6, "val_loss": 2.5}
    assert res.ranks[1].last_eval == {"step": 6, "val_loss": 2.5}
    assert "evaluation at step 6: val_loss 2.5" in format_run(res)


def test_no_evaluation_line_without_one(tmp_path):
    write_run(tmp_path / "r", world_size=1, steps=4, warmup=1)
    res = aggregate(tmp_path / "r")
    assert res.last_eval is None and "evaluation at step" not in format_run(res)


@pytest.mark.parametrize(("state", "slurm_code", "expected"),
                         [("FAILED", "143:0", 1), ("FAILED", "1:0", 1), ("COMPLETED", "0:0", 0),
                          ("TIMEOUT", "0:15", 1), ("OUT_OF_MEMORY", "0:125", 1), ("CANCELLED", "9:0", 9)])
def test_a_slurm_job_whose_rank_failed_exits_1_whatever_srun_returned(tmp_path, state, slurm_code,
                                                                      expected):
    from launcher.backends.slurm.follow import ended_of
    from launcher.backends.slurm.queue import JobInfo
    from launcher.drivers.launch import settle

    run = write_run(tmp_path / "r", world_size=2, result=None)
    info = JobInfo(job_id="8", state=state, exit_code=slurm_code)
    result = settle(run, ended_of(run, info, {"submitted_at": 1.0e9}))
    assert result.exit_code == expected
    assert json.loads(RunPaths(root=run).result.read_text())["exit_code"] == expected
    assert (result.status == "ok") == (state == "COMPLETED")

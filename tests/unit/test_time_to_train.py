"""Time to train: goal over the plan's rate, plus checkpoint and failure losses, by hand."""

from __future__ import annotations

import math

import pytest

from launcher.errors import PlanError, UsageError
from launcher.plan.time_to_train import (
    MTBF_GPU_HOURS,
    GoodputModel,
    PlanRate,
    TrainGoal,
    format_duration,
    time_to_train,
)

# Llama-3-70B-like: 1,024 GPUs, 4M-token batches (512 x 8192), 10 s a step, 1.1 GiB state a rank
RATE = PlanRate(step_s=10.0, global_batch=512, units_per_sample=8192, world_size=1024,
                devices_per_node=8, state_bytes_per_rank=70e9 * 16 / 1024)


def test_the_llama3_failure_rate_is_one_per_50700_gpu_hours():
    assert MTBF_GPU_HOURS == pytest.approx(54 * 24 * 16384 / 419) and 50_000 < MTBF_GPU_HOURS < 51_000


def test_time_is_the_goal_over_the_rate_plus_itemised_losses():
    t = time_to_train(TrainGoal(tokens=1e12), RATE)
    assert t.steps == math.ceil(1e12 / (512 * 8192))
    assert t.ideal_s == pytest.approx(t.steps * 10.0)
    tokens_per_s = 512 * 8192 / 10.0
    assert t.ideal_s == pytest.approx(1e12 / tokens_per_s, rel=1e-3)
    # every second of wall time is training, saving or lost to a failure
    assert t.wall_s == pytest.approx(t.ideal_s + t.checkpoint_loss_s + t.failure_loss_s, rel=1e-9)
    assert t.goodput == pytest.approx(t.ideal_s / t.wall_s)
    # by hand: a save writes 8 ranks x 1.09 GB at 2 GB/s; the job fails every 49.5 h
    save = 8 * 70e9 * 16 / 1024 / 2e9
    mtbf = MTBF_GPU_HOURS * 3600 / 1024
    assert t.checkpoint_save_s == pytest.approx(save)
    assert t.checkpoint_interval_s == pytest.approx(math.sqrt(2 * save * mtbf))
    assert t.expected_failures == pytest.approx(t.wall_s / mtbf)
    assert 0.95 < t.goodput < 1.0 and t.gpu_hours == pytest.approx(t.wall_s * 1024 / 3600)
    assert t.cost is None and any("arXiv 2407.21783" in a for a in t.assumptions)


def test_more_gpus_fail_more_often_and_cost_is_gpu_hours_times_price():
    priced = GoodputModel(gpu_hour_price=2.5)
    small = time_to_train(TrainGoal(tokens=1e12), RATE, priced)
    big = time_to_train(TrainGoal(tokens=1e12), PlanRate(**{**RATE.__dict__, "world_size": 8192}), priced)
    assert big.goodput < small.goodput
    assert small.cost == pytest.approx(small.gpu_hours * 2.5)


def test_goals_in_samples_and_steps():
    assert time_to_train(TrainGoal(samples=1024), RATE).steps == 2
    assert time_to_train(TrainGoal(samples=1025), RATE).steps == 3
    assert time_to_train(TrainGoal(steps=7), RATE).steps == 7


def test_bad_goals_and_a_job_that_cannot_finish_are_one_line_errors():
    with pytest.raises(UsageError, match="give one training goal"):
        TrainGoal(tokens=1e12, steps=10)
    with pytest.raises(UsageError, match="--tokens must be a finite number > 0"):
        TrainGoal(tokens=float("nan"))
    with pytest.raises(UsageError, match="--mtbf-gpu-hours"):
        GoodputModel(mtbf_gpu_hours=0)
    # a failure every 36 s of job time on 100,000 GPUs with 10-minute restarts: never finishes
    with pytest.raises(PlanError, match="would never finish"):
        time_to_train(TrainGoal(tokens=1e12), PlanRate(**{**RATE.__dict__, "world_size": 100_000}),
                      GoodputModel(mtbf_gpu_hours=1000))


def test_durations_read_as_people_say_them():
    assert [format_duration(s) for s in (40, 720, 5 * 3600, 3 * 86400)] == ["40 s", "12 min", "5.0 h", "3.0 days"]



def test_huge_durations_read_in_years_then_as_beyond_reach():
    year = 365.25 * 86_400
    assert format_duration(400 * 86_400) == "400.0 days"  # under two years: days still
    assert [format_duration(y * year) for y in (7.42, 1234.4, 999_999)] == ["7.4 years", "1,234 years",
                                                                          "999,999 years"]
    # what `--tokens 1e40` used to print as 118974026199857152957383442432.0 days
    assert [format_duration(x) for x in (1.19e29 * 86_400, float("inf"), float("nan"))] == [
        "more than 1,000,000 years"] * 3


def test_plan_with_a_token_goal_reports_time_gpu_hours_and_goodput(capsys):
    import json

    from launcher.cli.main import main

    code = main(["plan", "workloads/gpt.py", "--topology", "h100-sxm-8x128node-ib", "--tokens", "1e12",
                 "--json", "--", "--size", "llama3-70b"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    plan, ttt = out["plan"], out["time_to_train"]
    ideal_s = 1e12 / plan["units_per_s"]  # tokens over the plan's predicted tokens/s
    assert ttt["ideal_s"] == pytest.approx(ideal_s, rel=0.01)
    assert ttt["wall_s"] == pytest.approx(ttt["ideal_s"] + ttt["checkpoint_loss_s"] + ttt["failure_loss_s"],
                                          rel=1e-9)
    assert ttt["gpu_hours"] == pytest.approx(ttt["wall_s"] * plan["world_size"] / 3600)
    assert 0.9 < ttt["goodput"] < 1 and ttt["cost"] is None


def test_two_goals_are_one_line_exit_2(capsys):
    from launcher.cli.main import main

    assert main(["plan", "workloads/gpt.py", "--tokens", "1e9", "--train-steps", "10"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "give one training goal" in err[0]

"""`dlaunch plan --world-sizes` (launcher.plan.sizing, launcher.cli.plan): one plan per size, the
pick under a deadline or budget, and rows that agree with single plans."""

from __future__ import annotations

import pytest

from launcher.errors import PlanError, UsageError
from launcher.plan.sizing import SizeRow, parse_duration_s, parse_world_sizes, pick, with_efficiency
from launcher.plan.time_to_train import PlanRate, TrainGoal, time_to_train

from tests.helpers import assert_one_line_error, run_dlaunch, seeded_cache

GOAL = TrainGoal(tokens=1e12)


def row(n: int, step_s: float, price: float | None = 2.0) -> SizeRow:
    from launcher.plan.time_to_train import GoodputModel

    rate = PlanRate(step_s=step_s, global_batch=4 * n, units_per_sample=4096, world_size=n,
                    devices_per_node=8, state_bytes_per_rank=1e9)
    model = GoodputModel() if price is None else GoodputModel(gpu_hour_price=price)
    return SizeRow(world_size=n, nodes=max(1, n // 8), label="FSDP full bf16", step_s=step_s,
                   units_per_s=rate.global_batch * 4096 / step_s, efficiency=1.0,
                   ttt=time_to_train(GOAL, rate, model))


def test_parsing_sizes_and_durations():
    assert parse_world_sizes("256, 64,128,64") == (64, 128, 256)
    assert parse_duration_s("30d") == 30 * 86_400 and parse_duration_s("1.5h") == 5400
    assert parse_duration_s("90") == 90
    for bad in ("", "a,b", "0,8"):
        with pytest.raises(UsageError):
            parse_world_sizes(bad)
    with pytest.raises(UsageError):
        parse_duration_s("soon")


def test_efficiency_is_per_gpu_throughput_against_the_smallest_size():
    rows = with_efficiency([row(64, 10.0), row(128, 11.0)])
    assert rows[0].efficiency == 1.0 and rows[1].efficiency == pytest.approx(10 / 11)


def test_deadline_picks_the_cheapest_that_meets_it_and_says_why_the_others_lost():
    rows = with_efficiency([row(64, 10.0), row(128, 10.5), row(256, 12.0)])
    days = {r.world_size: r.ttt.wall_s / 86_400 for r in rows}
    deadline = (days[64] + days[128]) / 2 * 86_400  # 64 GPUs too slow, 128 and 256 in time
    best, why = pick(rows, deadline_s=deadline)
    assert best.world_size == 128  # cheaper than 256: its steps scale better
    assert why[0].startswith("128 GPUs: the cheapest (cost)")
    assert any(w.startswith("64 GPUs: takes") and "past the deadline" in w for w in why)
    assert any(w.startswith("256 GPUs: cost") for w in why)


def test_budget_picks_the_fastest_within_it_and_the_impossible_is_an_error():
    rows = with_efficiency([row(64, 10.0), row(128, 10.5), row(256, 12.0)])
    costs = sorted(r.ttt.cost for r in rows)
    best, _ = pick(rows, budget=costs[1] * 1.0001)  # the two cheapest fit
    assert best.world_size == 128  # the faster of the two
    with pytest.raises(PlanError, match="meets the budget: .*; try more GPUs or a larger budget$"):
        pick(rows, budget=costs[0] / 2)  # no deadline given: none suggested
    with pytest.raises(PlanError, match="meets the deadline: .*; try more GPUs or a later deadline$"):
        pick(rows, deadline_s=60.0)


def test_without_a_price_the_budget_is_gpu_hours():
    rows = with_efficiency([row(64, 10.0, price=None), row(128, 10.5, price=None)])
    best, why = pick(rows, budget=rows[0].ttt.gpu_hours * 1.0001)
    assert best.world_size == 64 and "GPU-hours" in why[1]


def test_rows_agree_with_single_plans_and_bad_input_is_one_line(tmp_path):
    env = {"DLAUNCH_CACHE_DIR": str(seeded_cache(tmp_path / "cache"))}
    common = ["plan", "workloads/gpt.py", "--topology", "h100-sxm-8x128node-ib", "--global-batch", "256",
              "--tokens", "1e10", "--json"]
    table = run_dlaunch(*common, "--world-sizes", "8,16", env=env)
    assert table.code == 0, table.err
    data = table.json()
    assert [r["world_size"] for r in data["rows"]] == [8, 16]
    for r in data["rows"]:
        single = run_dlaunch(*common, "--nodes", str(r["nodes"]), env=env)
        assert single.code == 0, single.err
        one = single.json()
        assert r["plan"]["chosen"] == one["plan"]["chosen"]
        assert r["time_to_train"]["wall_s"] == pytest.approx(one["time_to_train"]["wall_s"], rel=1e-9)
    assert_one_line_error(run_dlaunch(*common, "--world-sizes", "8,16", "--deadline", "60s", env=env),
                          "no world size planned meets the deadline")
    assert_one_line_error(run_dlaunch(*common, "--world-sizes", "12", env=env), "not whole nodes of 8")
    assert_one_line_error(run_dlaunch(*common, "--deadline", "1d", env=env), "--world-sizes")


def test_a_size_where_nothing_fits_is_named_beside_the_sizes_that_plan(tmp_path):
    env = {"DLAUNCH_CACHE_DIR": str(seeded_cache(tmp_path / "cache"))}
    common = ["plan", "workloads/gpt.py", "--topology", "a100-sxm-8x8node-ib"]
    out = run_dlaunch(*common, "--json", "--world-sizes", "8,64", "--", "--size", "llama3-70b", env=env)
    assert out.code == 0, out.err
    data = out.json()
    assert [r["world_size"] for r in data["rows"]] == [64] and data["rows"][0]["efficiency"] == 1.0
    assert list(data["not_planned"]) == ["8"] and data["not_planned"]["8"].startswith("nothing fits on 8 x")
    text = run_dlaunch(*common, "--world-sizes", "8,64", "--", "--size", "llama3-70b", env=env)
    assert text.code == 0 and "     8 GPUs: not planned: nothing fits on 8 x" in text.out
    # no size fits: the planner's one line
    assert_one_line_error(run_dlaunch(*common, "--world-sizes", "8", "--", "--size", "llama3-70b", env=env),
                          "nothing fits on 8 x")

"""A real 2-rank run's reported numbers, recomputed from what the ranks wrote: throughput over
wall time from the rank files' own timestamps, and the prediction line against plan.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.specs import GIB

from tests.helpers import Done, rank_records, run_dlaunch, run_result

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def mlp_run(tmp_path_factory) -> tuple[Path, Done]:
    # no --strategy/--precision/--micro-batch: the run follows the plan and keeps plan.json
    tmp = tmp_path_factory.mktemp("numbers")
    run_dir = tmp / "run"
    done = run_dlaunch("run", "workloads/mlp.py", "--gpus", "2", "--steps", "12",
                       "--run-dir", str(run_dir), env={"TMPDIR": str(tmp)})
    assert done.code == 0, done.err[-3000:]
    return run_dir, done


def test_samples_per_s_is_global_samples_over_wall_time(mlp_run):
    run_dir, _ = mlp_run
    result = run_result(run_dir)
    samples, walls, step_sum = 0, [], 0.0
    for rank in range(2):
        steps = [r for r in rank_records(run_dir, rank) if r["kind"] == "step"]
        warm = [r for r in steps if r["warmup"]]
        measured = [r for r in steps if not r["warmup"]]
        assert warm and measured
        samples += sum(r["samples"] for r in measured)
        # end of warm-up to the end of the last step, on this rank's own clock
        walls.append(measured[-1]["end_time"] - warm[-1]["end_time"])
        step_sum += sum(r["step_time_s"] for r in measured)
    expected = samples / max(walls)
    assert result["throughput_basis"] == "wall clock"
    assert result["samples_per_s"] == pytest.approx(expected, rel=0.01), (result["samples_per_s"], expected)
    # the old definition (step times only) can only read higher: a step's wall span holds it
    assert result["samples_per_s"] <= samples / (step_sum / 2) * (1 + 1e-9)


def test_the_summary_sets_the_prediction_against_the_measurement(mlp_run):
    run_dir, done = mlp_run
    plan = json.loads((run_dir / "plan.json").read_text())["plan"]["chosen"]
    predicted_s = plan["time"]["compute_s"] + plan["time"]["comm_exposed_s"]
    predicted_gib = sum(plan["memory"][k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes",
                                                    "activations_bytes", "overhead_bytes")) / GIB
    result = run_result(run_dir)
    block = result["prediction"]
    assert block["available"] and block["step_time_s"] == pytest.approx(predicted_s)
    assert block["measured_step_time_s"] == pytest.approx(result["step_time_median_s"])
    assert block["step_time_ratio"] == pytest.approx(result["step_time_median_s"] / predicted_s)
    # on CPU the plan is compared with live tensor bytes (a sampled warm-up step), not the RSS
    live = [r["live_peak_bytes"] for r in result["ranks"]]
    assert all(n and n < r["peak_mem_bytes"] for n, r in zip(live, result["ranks"])), result["ranks"]
    peak_gib = max(live) / GIB
    assert block["mem_ratio"] == pytest.approx(peak_gib / predicted_gib)
    [line] = [x for x in done.out.splitlines() if x.startswith("prediction")]
    low, high = block["step_interval_s"]  # the plan's 80% interval, and whether the run fell in it
    inside = "inside the interval" if low <= result["step_time_median_s"] <= high else "OUTSIDE the interval"
    assert block["inside_interval"] == (inside == "inside the interval")
    assert line.startswith(f"prediction vs measured (plan.json): step time {predicted_s:.3f} s predicted "
                           f"({low:.3g}-{high:.3g} s, 80%), {result['step_time_median_s']:.3f} s measured median "
                           f"(measured/predicted {block['step_time_ratio']:.2f}, {inside})"), line
    assert "peak live tensor bytes" in line  # a CPU run names what it measured
    # the memory line labels both figures and prints the plan's estimate beside them
    [mem] = [x for x in done.out.splitlines() if x.startswith("memory")]
    assert "live tensors" in mem and "process RSS" in mem and "the plan estimated" in mem

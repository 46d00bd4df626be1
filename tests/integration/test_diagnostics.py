"""--profile, --memory-snapshot, --detect-anomaly and the bottleneck verdict, in real ranks."""

import json

import pytest

from launcher.rundir import RunPaths

from tests.helpers import DATA, REPO, assert_one_line_error, rank_records, run_result, step_losses

MLP = str(REPO / "workloads" / "mlp.py")
SLOW = str(DATA / "slow_data.py")


@pytest.mark.distributed
def test_profile_writes_a_trace_per_rank_and_top_operators(dlaunch, tmp_path):
    run_dir = tmp_path / "run"
    done = dlaunch("run", MLP, "--gpus", "2", "--strategy", "ddp", "--precision", "fp32",
                   "--micro-batch", "8", "--steps", "5", "--warmup-steps", "1", "--profile",
                   "--run-dir", str(run_dir))
    assert done.code == 0, done.out + done.err
    paths = RunPaths(root=run_dir)
    for rank in (0, 1):
        trace = json.loads(paths.trace(rank).read_text())
        assert trace["traceEvents"], "empty trace"
    result = run_result(run_dir)
    r0 = result["ranks"][0]
    assert r0["profile_trace"].endswith(paths.trace(0).name) and len(r0["top_ops"]) >= 3
    assert r0["top_ops"][0]["self_s"] >= r0["top_ops"][1]["self_s"] > 0
    # wait 1 (warm-up) + 1 profiler warm-up, then steps 3-5 recorded and left out of throughput
    assert [r["step"] for r in rank_records(run_dir) if r.get("profiled")] == [3, 4, 5]
    assert r0["steady_steps"] == 1
    assert "top operators by self CPU time" in done.out and "aten::" in done.out


def verdict_of(dlaunch, tmp_path, workers: int) -> dict:
    run_dir = tmp_path / f"workers-{workers}"
    done = dlaunch("run", SLOW, "--strategy", "ddp", "--precision", "fp32", "--micro-batch", "4",
                   "--steps", "8", "--warmup-steps", "3", "--num-workers", str(workers),
                   "--run-dir", str(run_dir), "--", "--sleep-ms", "10", "--compute-ms", "10")
    assert done.code == 0, done.out + done.err
    result = run_result(run_dir)
    assert f"verdict: {result['verdict']['name']}: " in done.out
    return result


@pytest.mark.distributed
@pytest.mark.alone  # its reader must keep pace with the step's compute
def test_slow_dataset_without_workers_is_data_loading_bound(dlaunch, tmp_path):
    # 10 ms per item read in the loop, 10 ms per sample of compute: about half the step waits
    result = verdict_of(dlaunch, tmp_path, workers=0)
    assert result["verdict"]["name"] == "data-loading bound", result["verdict"]
    assert result["verdict"]["shares"]["data_wait"] > 0.3
    assert "waiting for batches" in result["verdict"]["evidence"]


@pytest.mark.distributed
@pytest.mark.alone  # its reader must keep pace with the step's compute
def test_slow_dataset_with_workers_is_not_data_loading_bound(dlaunch, tmp_path):
    # 3 workers make a 40 ms batch each: one ready every ~13 ms against a 40 ms step
    result = verdict_of(dlaunch, tmp_path, workers=3)
    assert result["verdict"]["name"] != "data-loading bound", result["verdict"]
    assert result["verdict"]["shares"]["data_wait"] < 0.2


@pytest.mark.distributed
def test_detect_anomaly_names_the_op_that_made_the_nan_under_tensor_parallelism(dlaunch, tmp_path):
    # anomaly mode's NaN check on DTensor gradients: torch has no sharding rule for the op it calls
    # (aten._is_any_true), which dlaunch registers; the first step's backward passes the check,
    # the second's NaN is traced to the multiply that made it, and the summary names the rank
    run_dir = tmp_path / "run"
    done = dlaunch("run", str(DATA / "gpt_tp_fault.py"), "--gpus", "2", "--tp", "2", "--strategy", "fsdp_full",
                   "--micro-batch", "2", "--steps", "4", "--no-calibrate", "--detect-anomaly",
                   "--run-dir", str(run_dir), "--", "--seq-len", "32", "--fault", "nan", "--fault-step", "2")
    assert done.code != 0
    assert "rank 0 failed: RuntimeError: Function 'MulBackward0' returned nan values" in done.out + done.err
    assert "_is_any_true" not in done.out + done.err
    assert [s for s, _ in step_losses(rank_records(run_dir, 0))][:1] == [1]  # the metrics written are kept


def test_memory_snapshot_needs_cuda(dlaunch):
    done = dlaunch("run", MLP, "--strategy", "ddp", "--precision", "fp32", "--micro-batch", "4",
                   "--memory-snapshot", "--dry-run")
    assert_one_line_error(done, "--memory-snapshot", "needs a GPU")


@pytest.mark.parametrize("args, needle", [
    (("--strategy", "ddp", "--shard-group-size", "2"), "--shard-group-size applies to --strategy hybrid"),
    (("--strategy", "hybrid", "--gpus", "4", "--shard-group-size", "3"), "must divide the world size (4)"),
    (("--strategy", "ddp", "--profile", "--steps", "4", "--warmup-steps", "3"), "--profile needs --steps >= "),
])
def test_bad_diagnostic_flags_are_one_line_errors(dlaunch, args, needle):
    done = dlaunch("run", MLP, "--precision", "fp32", "--micro-batch", "4", *args, "--dry-run")
    assert_one_line_error(done, needle)


def test_logging_windows_are_the_same_on_every_rank():
    """Windows end at the same step on every rank (the loss all-reduce is a collective): the
    length comes from the rank-averaged step time, capped by --log-every and the flush interval."""
    from launcher.runtime.harness import FLUSH_INTERVAL_S, window_steps

    assert window_steps(0.01, 10) == 10
    assert window_steps(FLUSH_INTERVAL_S / 3, 10) == 3
    assert window_steps(FLUSH_INTERVAL_S * 4, 10) == 1
    assert window_steps(0.0, 7) == 7

"""Outside GPU scripts launched unchanged on CPU, under real torchrun with 2 ranks: each rank is
labelled with its own error (never the SIGTERM torchrun sent after another rank failed), and
the summary says in one line what to change. A script that exits 0 without training is not
plain OK."""

from __future__ import annotations

import pytest

from launcher.rundir import RunPaths

from tests.helpers import DATA, run_result

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("script,error,fix", [
    ("misfit_nccl.py", "RuntimeError: Distributed package doesn't have NCCL built in",
     "dist.init_process_group('gloo')"),
    ("misfit_set_device.py", "_cuda_setDevice", "torch.cuda.is_available()"),
    ("misfit_device_ids.py", "device_ids and output_device arguments only work",
     "DistributedDataParallel(model) on CPU"),
])
def test_a_gpu_script_on_cpu_names_its_own_error_and_the_fix(dlaunch, tmp_path, script, error, fix):
    run_dir = tmp_path / "run"
    done = dlaunch("run", str(DATA / script), "--gpus", "2", "--run-dir", str(run_dir),
                   env={"CUDA_VISIBLE_DEVICES": ""})
    assert done.code != 0, done.out
    result = run_result(run_dir)
    raised = 0
    for rank in result["ranks"]:
        [log] = RunPaths(root=run_dir).rank_logs(0, rank["rank"], "stderr")
        if error in log.read_text():
            # it raised: its own error, whatever torchrun sent it afterwards
            raised += 1
            assert rank["status"] == "failed" and error in (rank["error"] or ""), rank
        else:  # torchrun stopped it before it got that far (a race): then say so
            assert rank["status"] == "stopped" and "SIGTERM" in rank["error"], rank
    assert raised >= 1, result["failures"]
    failed = [line for line in done.out.splitlines() if line.startswith("FAILED: rank")]
    assert len(failed) == 2, done.out
    # the fix is said once, on one line
    assert sum("what to change: " in line and fix in line for line in failed) == 1, failed


def test_a_script_that_exits_0_without_training_is_not_plain_ok(dlaunch, tmp_path):
    run_dir = tmp_path / "run"
    done = dlaunch("run", str(DATA / "exits_without_training.py"), "--gpus", "2",
                   "--run-dir", str(run_dir), env={"CUDA_VISIBLE_DEVICES": ""})
    assert done.code == 0, done.err[-2000:]
    [head] = [line for line in done.out.splitlines() if line.startswith("run ")]
    assert "OK, NO STEPS REPORTED" in head, done.out
    assert " 0.0 " not in done.out and "0.000s" not in done.out
    assert run_result(run_dir)["status"] == "ok"

"""Fault injection with real processes (torchrun, gloo, 2 CPU ranks): a rank that raises, is
SIGKILLed, hangs inside a collective, exits 0 early, raises leaving a child that ignores
SIGTERM, or waits forever on its DataLoader; and a restart after a failed attempt.

Each job must end within (hang timeout +) 15 s of the fault, exit non-zero, name the right
rank first, and keep every metric written before the fault readable. The seven jobs run at
the same time (one module fixture) to keep the suite short; that they do not disturb each
other is part of what is tested.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from launcher.results.aggregate import aggregate
from launcher.results.types import RunResult
from launcher.rundir import RunPaths

from tests.helpers import DATA, REPO, assert_processes_gone, rank_records, run_result

pytestmark = pytest.mark.distributed

HANG_TIMEOUT_S = 10
FAULT_STEP = 3  # the faulty rank's 3rd loss_fn call: steps 1 and 2 are on disk
STUCK_HANG_TIMEOUT_S = HANG_TIMEOUT_S
COMMON = ["--gpus", "2", "--steps", "8", "--log-every", "1", "--no-calibrate",
          "--strategy", "ddp", "--precision", "fp32", "--micro-batch", "8"]
# name -> (dlaunch's options, the fault through fault.py's environment defaults): the same workload
# arguments in every job, so one cached plan serves all; the slowest to detect start first
JOBS: dict[str, tuple[list[str], dict[str, str]]] = {
    # stuck from the first batch, so dlaunch still counts the job as starting up: rank 0's
    # collective times out first (twice the hang timeout)
    "stuck-data": (["--hang-timeout-s", str(STUCK_HANG_TIMEOUT_S), "--num-workers", "1"],
                   {"DLAUNCH_TEST_FAULT": "stuck-data"}),
    "hang": (["--hang-timeout-s", str(HANG_TIMEOUT_S)], {"DLAUNCH_TEST_FAULT": "hang"}),
    "raise": ([], {"DLAUNCH_TEST_FAULT": "raise"}),
    "sigkill": ([], {"DLAUNCH_TEST_FAULT": "sigkill"}),
    "exit0": ([], {"DLAUNCH_TEST_FAULT": "exit0"}),
    "stubborn": ([], {"DLAUNCH_TEST_FAULT": "stubborn"}),
    "restart": (["--max-restarts", "1"], {"DLAUNCH_TEST_FAULT": "sigkill", "DLAUNCH_TEST_FAULT_ATTEMPT": "0"}),
}


@dataclass
class Job:
    run_dir: Path
    code: int
    out: str
    err: str
    ended: float  # wall clock when dlaunch exited
    started: float  # wall clock when dlaunch was started

    def failures(self) -> list[str]:
        return [line for line in self.out.splitlines() if line.startswith("FAILED: ")]

    def steps(self, rank: int) -> list[dict]:
        return [r for r in rank_records(self.run_dir, rank) if r["kind"] == "step"]

    def fault_time(self) -> float:
        """The end of the last step any rank recorded: the fault came right after."""
        return max(r["time"] for rank in (0, 1) for r in self.steps(rank))


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Job]]:
    root = tmp_path_factory.mktemp("faults")
    env = {**os.environ, "TMPDIR": str(root), "OMP_NUM_THREADS": "1"}
    env.pop("DLAUNCH_DEBUG", None)
    command = [sys.executable, "-m", "launcher.cli.main", "run", str(DATA / "fault.py"), *COMMON]
    # the plan measured once, alone, before the jobs: each job then plans from the cache
    warm = subprocess.run([*command, "--dry-run"], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert warm.returncode == 0, warm.stdout + warm.stderr
    procs = {}
    started = time.time()
    for name, (extra, fault_env) in JOBS.items():
        procs[name] = subprocess.Popen([*command, "--run-dir", str(root / name), *extra], cwd=REPO,
                                       env={**env, **fault_env}, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
    done: dict[str, Job] = {}
    deadline = time.monotonic() + 240
    while procs:
        for name, p in list(procs.items()):
            if p.poll() is not None:
                out, err = p.communicate()
                done[name] = Job(root / name, p.returncode, out, err, time.time(), started)
                del procs[name]
        if time.monotonic() > deadline:
            for p in procs.values():
                p.kill()
            pytest.fail(f"jobs still running after 240 s: {sorted(procs)}")
        time.sleep(0.2)
    yield done
    # no rank, torchrun or DataLoader worker of any job outlives it
    left = [p.pid for p in psutil.process_iter() if _environ(p).get("TMPDIR") == str(root)]
    assert_processes_gone(set(left), within_s=1.0)


def _environ(p: psutil.Process) -> dict[str, str]:
    try:
        return p.environ()
    except (psutil.Error, OSError):
        return {}


# within_s bounds how long after the fault dlaunch exits (fault detection, not a speed): the six
# jobs at once on the 2-core AMD EPYC VM at load 1-4 (2026-11-28) took raise 2.9 s, sigkill 2.6,
# exit0 3.2, stubborn 6.1 and hang 12.0 (the 10 s timeout + 2.0; bound HANG_TIMEOUT_S + 15: 7.5x
# the 2.0 s after the timeout). With the seventh job (stuck-data) beside them, CI's clean-clone
# run took stubborn 15.0 s: bound FAULT_EXIT_S, 2x that
FAULT_EXIT_S = 30
def _check_common(job: Job, *, within_s: float) -> None:
    assert job.code != 0, job.out + job.err
    assert "Traceback" not in job.out
    # every metric written before the fault is still readable: steps 1..2 on both ranks
    for rank in (0, 1):
        assert [r["step"] for r in job.steps(rank)] == list(range(1, FAULT_STEP)), rank
    assert job.ended - job.fault_time() <= within_s, (job.ended - job.fault_time(), job.out)
    result = run_result(job.run_dir)
    assert result["status"] == "failed"
    # the result of a finished run never changes when the run dir is read again
    again = aggregate(job.run_dir, exit_code=result["exit_code"], wall_time_s=result["wall_time_s"])
    assert again == RunResult.from_dict(result) == aggregate(
        job.run_dir, exit_code=result["exit_code"], wall_time_s=result["wall_time_s"])


def test_rank_raising_is_named_with_its_exception(jobs):
    job = jobs["raise"]
    _check_common(job, within_s=FAULT_EXIT_S)
    first = job.failures()[0]
    assert first.startswith("FAILED: rank 1 (host ") and "failed after 2 steps" in first
    assert "ValueError: injected failure at step 3" in first
    assert "last lines of rank 1's stderr:" in job.out


def test_sigkilled_rank_is_named_with_its_signal(jobs):
    job = jobs["sigkill"]
    _check_common(job, within_s=FAULT_EXIT_S)
    first = job.failures()[0]
    assert first.startswith("FAILED: rank 1 (host ") and "killed after 2 steps" in first
    assert "SIGKILL (9)" in first
    summary = json.loads(RunPaths(root=job.run_dir).summary(1).read_text())
    assert summary["written_by"] == "dlaunch" and summary["status"] == "killed"


def test_rank_hanging_in_a_collective_is_found_by_its_heartbeat(jobs):
    job = jobs["hang"]
    _check_common(job, within_s=HANG_TIMEOUT_S + 15)
    assert job.code == 124
    assert f"no rank advanced for {HANG_TIMEOUT_S}" in job.out  # said while it happens
    first, second = job.failures()[:2]
    # the ranks that stopped advancing and the step each reached; the one in its own code first
    assert first.startswith("FAILED: rank 1 (host ") and "hung after 2 steps" in first
    assert "rank 0 at step 2, rank 1 at step 2" in first and "stuck in _inject" in first
    assert second.startswith("FAILED: rank 0 ") and "waiting in" in second
    assert "most likely for rank(s) 1" in second


def test_rank_exiting_0_early_ends_the_job(jobs):
    job = jobs["exit0"]
    _check_common(job, within_s=FAULT_EXIT_S)
    first = job.failures()[0]
    assert first.startswith("FAILED: rank 1 (host ") and "exited after 2 steps" in first
    assert "exit code 0 before finishing its 8 steps" in first


def test_a_rank_raising_with_a_child_that_ignores_sigterm_ends_as_its_failure(jobs):
    job = jobs["stubborn"]
    _check_common(job, within_s=FAULT_EXIT_S)
    assert job.code == 1
    first = job.failures()[0]
    assert first.startswith("FAILED: rank 1 (host ") and "failed after 2 steps" in first
    assert "ValueError: injected failure at step 3, a stubborn child left running" in first
    # the keeper ended the child the job left, said so, and kept it in the result's warnings
    stubborn = int((job.run_dir.parent / "stubborn.pid").read_text())
    assert_processes_gone({stubborn}, within_s=1.0)
    said = [line for line in job.out.splitlines() if "the job left 1 process(es) running" in line]
    assert said and f"pid {stubborn}: " in said[0], job.out[-3000:]
    assert any(w.startswith("the job left 1 process(es)") for w in run_result(job.run_dir)["warnings"])


def test_max_restarts_relaunches_with_a_fresh_rendezvous(jobs):
    job = jobs["restart"]
    assert job.code == 0, job.out + job.err
    assert "attempt 0 failed (rank 1 " in job.err + job.out and "restarting" in job.err + job.out
    result = run_result(job.run_dir)
    assert result["status"] == "ok" and [r["steps"] for r in result["ranks"]] == [8, 8]
    # the failed attempt is kept aside; the top level is the attempt that succeeded
    first = run_result(RunPaths(root=job.run_dir).attempt(0).root)
    assert first["status"] == "failed" and "SIGKILL" in first["failures"][0]
    starts = [r for r in rank_records(job.run_dir) if r["kind"] == "start"]
    assert [s["attempt"] for s in starts] == [1]
    history = json.loads(RunPaths(root=job.run_dir).attempts_record.read_text())["attempts"]
    assert [a["attempt"] for a in history] == [0, 1]


def test_a_rank_stuck_on_its_input_pipeline_leads_the_failures(jobs):
    job = jobs["stuck-data"]
    assert job.code == 1 and "Traceback" not in job.out, job.out + job.err
    # the waiting rank's collective timed out (2 x 10 s) first, but the stuck rank is named first
    first, second = job.failures()[:2]
    assert first.startswith("FAILED: rank 1 (host ") and "hung after 0 steps" in first, job.out
    assert "stuck waiting for its DataLoader's next batch" in first
    assert "rank(s) 0 timed out waiting for it in a collective" in first
    assert second.startswith("FAILED: rank 0 ") and "Timed out waiting" in second
    # the ranks start, then the 20 s timeout: the seven jobs at once on the 2-core AMD EPYC VM
    # (2026-11-28) took 70 s for this one (bound 150 s: 2.1x)
    assert job.ended - job.started <= 150, job.ended - job.started
    assert run_result(job.run_dir)["failures"][0].startswith("rank 1 ")

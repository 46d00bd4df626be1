"""`dlaunch tune --slurm` against the real local cluster (scripts/slurm-cluster.sh): each trial is
its own SLURM job on both nodes, a crashing candidate fails its own job only, the tune's table,
tuned plan and report come out as on one host; a refused submission is one line and leaves
nothing. Kept small: at most 4 trials of 5 steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.rundir import RunPaths, TunePaths

from tests.helpers import DATA, REPO, Done, run_dlaunch

pytestmark = pytest.mark.slurm

# mlp.py whose first run in a marker dir crashes (--fail-first): the first trial's job fails and
# every later one trains, whichever candidates this CPU puts near the best
FAILS_FIRST = str(DATA / "fails_first.py")
TOPOLOGY = str(REPO / "topologies" / "cpu-local.yaml")
TUNE = ("tune", FAILS_FIRST, "--slurm", "--nodes", "2", "--gpus", "1", "--trials", "4", "--steps", "5",
        "--warmup-steps", "2", "--topology", TOPOLOGY)


@pytest.fixture
def sl(slurm_cluster, tmp_path: Path):
    """`sl(*args)`: dlaunch in tmp_path with one thread per rank (the two fake nodes share two
    cores), TMPDIR and dlaunch's cache inside the test dir; sbatch exports this env."""
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    slurm_cluster.wait_idle()

    def call(*args: str, **kw) -> Done:
        env = {"TMPDIR": str(tmp), "OMP_NUM_THREADS": "1", "DLAUNCH_CACHE_DIR": str(tmp_path / "cache")}
        return run_dlaunch(*args, cwd=tmp_path, env=env, **kw)

    return call


def test_each_trial_is_its_own_job_and_the_tune_reports(sl, slurm_cluster, tmp_path: Path):
    tune_dir = tmp_path / "tune"
    done = sl(*TUNE, "--tune-dir", str(tune_dir), "--json", "--", "--fail-first", str(tmp_path / "markers"),
              timeout=300)
    assert done.code == 0, done.out + done.err
    trials = done.json()["trials"]
    n = len(trials)
    assert 2 <= n <= 4 and "one SLURM job each" in done.err and f"[{n}/{n}]" in done.err
    jobs = {t["name"]: json.loads(RunPaths(root=t["run_dir"]).slurm.read_text())["job_id"] for t in trials}
    assert len(set(jobs.values())) == n, jobs  # one job per trial
    for i, t in enumerate(trials):
        state = slurm_cluster.wait_sacct_state(jobs[t["name"]], "COMPLETED", "FAILED", "CANCELLED")
        if i == 0:  # the crashing candidate fails its own job, and only it
            assert t["status"] == "failed" and "injected failure" in t["reason"] and state == "FAILED"
            assert t["measured_step_s"] is None and not t["chosen"]
            continue
        assert t["status"] == "ok" and state == "COMPLETED"
        result = json.loads(RunPaths(root=t["run_dir"]).result.read_text())
        assert result["num_nodes"] == 2 and {r["host"] for r in result["ranks"]} == set(slurm_cluster.nodes)
        # the trial's plan.json is its own candidate's: predicted against measured
        assert result["prediction"]["available"] and result["prediction"]["step_time_s"] == pytest.approx(
            t["predicted_step_s"])
        assert t["measured_step_s"] == pytest.approx(result["step_time_median_s"])
        assert f"job {jobs[t['name']]} COMPLETED" in RunPaths(root=t["run_dir"]).console_log.read_text()
    best = max(trials[1:], key=lambda t: t["measured_samples_per_s"])
    assert [t["chosen"] for t in trials] == [t is best for t in trials]
    tuned = json.loads(TunePaths(root=tune_dir).tuned_plan.read_text())
    assert (tuned["nodes"], tuned["gpus"], tuned["decisions"]["precision"], tuned["decisions"]["checkpointing"]) == (
        2, 1, best["precision"], best["checkpointing"])
    assert "stored for the partition's nodes (cpu-local)" in done.err
    report = sl("report", str(tune_dir), "--format", "md,json")
    assert report.code == 0 and report.out.startswith(f"tune: {tune_dir}\n"), report.out + report.err
    data = json.loads((TunePaths(root=tune_dir).report / "report.json").read_text())
    assert [(t["name"], t["status"], t["chosen"]) for t in data["tune"]["trials"]] == [
        (t["name"], t["status"], t["chosen"]) for t in trials]


def test_dry_run_submits_nothing_and_a_refused_job_leaves_nothing(sl, slurm_cluster, tmp_path: Path):
    before = slurm_cluster.sacct("-X", "-n", "-P", "-o", "JobID")
    dry = sl(*TUNE, "--tune-dir", str(tmp_path / "dry"), "--dry-run")
    assert dry.code == 0, dry.err
    assert dry.out.count("#SBATCH --nodes=2") == dry.out.count("# trial ") >= 2
    assert not (tmp_path / "dry").exists() and not (tmp_path / "runs").exists()
    assert slurm_cluster.sacct("-X", "-n", "-P", "-o", "JobID") == before  # nothing was submitted
    bad = sl(*TUNE, "--partition", "nope", "--tune-dir", str(tmp_path / "bad"))
    assert bad.code == 2 and "Traceback" not in bad.err, bad.err
    assert bad.err.splitlines()[-1].startswith("dlaunch: error: SLURM refused the job: unknown partition 'nope'")
    assert not (tmp_path / "bad").exists()  # the claim taken back: nothing ran

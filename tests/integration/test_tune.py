"""`dlaunch tune` with real torchrun trials (2 CPU ranks, few steps): a candidate that crashes
is recorded and skipped, the fastest is written as tuned-plan.json and `run --plan` follows it,
each trial's run sets its own candidate's prediction against its measurement, `dlaunch report`
renders the tune dir's page, and the next `dlaunch plan` uses the stored correction unless
--no-calibration-cache.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from launcher.rundir import RunPaths, TunePaths

from tests.helpers import DATA, Done, run_dlaunch

pytestmark = [pytest.mark.distributed, pytest.mark.alone]

# mlp.py whose first run in a marker dir crashes (--fail-first): the first trial (the plan's own
# candidate) crashes and the second trains, whichever two candidates this CPU puts near the best
FAILS_FIRST = str(DATA / "fails_first.py")


@dataclass
class Tuned:
    done: Done
    tune_dir: Path
    env: dict[str, str]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> Tuned:
    root = tmp_path_factory.mktemp("tune")
    (root / "tmp").mkdir()
    # a cold cache of its own, not `seeded_cache`: a correction is stored only where a trial lands
    # within 2x of its plan, so the plan's CPU rates must be measured beside these trials, not
    # under the load of whatever test measured the suite's (CI saw a 3.4x miss that way)
    env = {"TMPDIR": str(root / "tmp"), "OMP_NUM_THREADS": "1", "DLAUNCH_CACHE_DIR": str(root / "cache")}
    tune_dir = root / "t"
    done = run_dlaunch("tune", FAILS_FIRST, "--gpus", "2", "--steps", "5", "--warmup-steps", "2",
                       "--trials", "2", "--tune-dir", str(tune_dir), "--json", *workload_args(root),
                       env=env, cwd=root)
    return Tuned(done=done, tune_dir=tune_dir, env=env)


def workload_args(root: Path) -> tuple[str, ...]:
    """The workload's arguments as the tune passes them (part of what the planner measures)."""
    return ("--", "--fail-first", str(root / "markers"))


def decisions(t: dict) -> tuple:
    return t["strategy"], t["precision"], t["micro_batch"], t["checkpointing"]


def test_a_crashing_candidate_is_recorded_and_the_tune_finishes(tuned: Tuned) -> None:
    assert tuned.done.code == 0, tuned.done.err
    trials = tuned.done.json()["trials"]
    assert len(trials) == 2 and decisions(trials[0]) != decisions(trials[1]), trials
    crashed, ok = trials
    assert crashed["status"] == "failed" and "injected failure" in crashed["reason"]
    assert crashed["measured_step_s"] is None and crashed["ratio"] is None and not crashed["chosen"]
    assert ok["status"] == "ok" and ok["chosen"] and ok["measured_samples_per_s"] > 0
    assert ok["ratio"] == pytest.approx(ok["measured_step_s"] / ok["predicted_step_s"])
    assert "[2/2]" in tuned.done.err and f"best so far: {ok['name']}" in tuned.done.err
    plan = json.loads((tuned.tune_dir / "tuned-plan.json").read_text())
    d = plan["decisions"]
    assert (d["strategy"], d["precision"], d["micro_batch"], d["checkpointing"]) == decisions(ok)
    assert plan["workload_args"] == list(workload_args(tuned.tune_dir.parent)[1:])


def test_run_follows_the_tuned_plan(tuned: Tuned) -> None:
    plan = json.loads((tuned.tune_dir / "tuned-plan.json").read_text())["decisions"]
    run_dir = tuned.tune_dir.parent / "followed"
    done = run_dlaunch("run", FAILS_FIRST, "--gpus", "2", "--steps", "2", "--no-calibrate", "--plan",
                       str(tuned.tune_dir / "tuned-plan.json"), "--run-dir", str(run_dir), "--json",
                       env=tuned.env, cwd=tuned.tune_dir.parent)
    assert done.code == 0, done.err
    launch = json.loads((run_dir / "launch.json").read_text())
    assert (launch["strategy"], launch["precision"], launch["micro_batch"],
            launch["grad_accum"], launch["checkpointing"]) == (
        plan["strategy"], plan["precision"], plan["micro_batch"], plan["grad_accum"], plan["checkpointing"])


def test_each_trial_carries_its_candidates_plan_and_prediction(tuned: Tuned) -> None:
    trials = tuned.done.json()["trials"]
    for t in trials:
        chosen = json.loads(RunPaths(root=t["run_dir"]).plan.read_text())["plan"]["chosen"]
        assert (chosen["strategy"]["kind"], chosen["strategy"]["precision"], chosen["micro_batch"],
                chosen["strategy"]["checkpointing"]) == (
            t["strategy"], t["precision"], t["micro_batch"], t["checkpointing"])
    ok = next(t for t in trials if t["status"] == "ok")
    prediction = json.loads(RunPaths(root=ok["run_dir"]).result.read_text())["prediction"]
    assert prediction["available"], prediction
    assert prediction["step_time_s"] == pytest.approx(ok["predicted_step_s"])
    assert prediction["measured_step_time_s"] == pytest.approx(ok["measured_step_s"])
    assert prediction["step_time_ratio"] == pytest.approx(ok["ratio"])
    console = RunPaths(root=ok["run_dir"]).console_log.read_text()
    assert "prediction vs measured (plan.json): step time" in console


def test_the_tune_dir_report_page(tuned: Tuned) -> None:
    trials = tuned.done.json()["trials"]
    ok = next(t for t in trials if t["chosen"])
    failed = next(t for t in trials if t["status"] == "failed")
    trial_report = run_dlaunch("report", ok["run_dir"], "--format", "html", env=tuned.env)
    assert trial_report.code == 0, trial_report.err
    done = run_dlaunch("report", str(tuned.tune_dir), env=tuned.env)
    assert done.code == 0, done.err
    out = TunePaths(root=tuned.tune_dir).report
    assert done.out.startswith(f"tune: {tuned.tune_dir}\n") and f"report: {out / 'report.html'}" in done.out
    page = (out / "report.html").read_text()
    table = page[page.index('<table id="tune">'):page.index("</table>", page.index('<table id="tune">'))]
    rows = {r.split("</a>")[0].rsplit(">", 1)[1]: r for r in table.split("<tr")[2:]}
    assert set(rows) == {t["name"] for t in trials}
    chosen = rows[ok["name"]]
    ok_dir = Path(ok["run_dir"]).name
    assert chosen.startswith(' class="chosen">') and f'href="../{ok_dir}/report/report.html"' in chosen
    assert f"<td>{ok['measured_samples_per_s']:,.1f}</td>" in chosen and f"<td>{ok['ratio']:.2f}</td>" in chosen
    # the crashed candidate: its status, nothing measured, its reason below the table
    cells = [c.split("</td>")[0] for c in rows[failed["name"]].split("<td>")[1:]]
    assert "failed" in cells[1] and cells[4:7] == ["-", "-", "-"]
    outcome = page[page.index('id="tune-outcome"'):]
    assert f"FAILED: {failed['name']}" in outcome and "injected failure" in outcome
    assert f"--plan {TunePaths(root=tuned.tune_dir).tuned_plan}" in outcome
    data = json.loads((out / "report.json").read_text())
    assert data["kind"] == "tune" and data["tune"]["tuned_plan"] == str(TunePaths(root=tuned.tune_dir).tuned_plan)
    assert [(t["name"], t["status"], t["chosen"]) for t in data["tune"]["trials"]] == [
        (t["name"], t["status"], t["chosen"]) for t in trials]
    # each trial is a point of the page too, with its own predicted vs measured
    point = next(p for p in data["points"] if p["name"] == ok_dir)
    assert point["prediction"]["step_time_s"] == pytest.approx(ok["predicted_step_s"])
    assert "## Tune" in (out / "report.md").read_text()


def test_plan_uses_the_stored_correction_unless_told_not_to(tuned: Tuned) -> None:
    ok = next(t for t in tuned.done.json()["trials"] if t["status"] == "ok")
    args = ("plan", FAILS_FIRST, "--gpus", "2", "--strategy", ok["strategy"], "--precision", ok["precision"],
            "--micro-batch", str(ok["micro_batch"]), "--json")
    # the workload as the tune ran it (its arguments are part of what the planner measures)
    corrected = run_dlaunch(*args, *workload_args(tuned.tune_dir.parent), env=tuned.env).json()["plan"]
    plain = run_dlaunch(*args, "--no-calibration-cache", *workload_args(tuned.tune_dir.parent),
                        env=tuned.env).json()["plan"]
    assert any(r.startswith("corrected by 1 tune trial (") for r in corrected["reasons"]), corrected["reasons"]
    assert not any("corrected by" in r for r in plain["reasons"])

    def trial_candidate(plan: dict) -> dict:
        """The plan's candidate with the trial's checkpointing (the plan may choose the other)."""
        return next(c for c in (plan["chosen"], *plan["rejected"])
                    if c["strategy"]["checkpointing"] == ok["checkpointing"]
                    and c["micro_batch"] == ok["micro_batch"] and c["strategy"]["kind"] == ok["strategy"])

    def step(c: dict) -> float:
        return sum(c["time"][k] for k in ("compute_s", "comm_exposed_s", "contention_s", "sync_wait_s"))
    # one trial: the corrected prediction of its candidate is close to its measurement
    assert step(trial_candidate(corrected)) == pytest.approx(ok["measured_step_s"], rel=0.1)
    assert trial_candidate(corrected)["time"]["compute_s"] != trial_candidate(plain)["time"]["compute_s"]

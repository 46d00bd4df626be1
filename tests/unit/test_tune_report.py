"""`dlaunch report TUNE_DIR` on a synthetic tune dir written by the real `drivers.tune.finish`: the
tune's table (measured only where measured), each failed or skipped trial with its reason, the
tuned plan, links to the trials and to a trial's own report, the same in report.md, report.json
and on the terminal; and a trial's plan.json gives its run the candidate's own prediction."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from launcher.drivers.tune import Trial, finish, trial_planned, trial_spec
from launcher.hardware.topology import load_topology
from launcher.plan.planfile import write_plan
from launcher.plan.resolve import Planned
from launcher.plan.search import plan
from launcher.report.render import render_report
from launcher.results.prediction import compare
from launcher.rundir import RunPaths, TunePaths
from launcher.runspec import LaunchSpec
from launcher.specs import Goal, ModelProfile

from tests.helpers import REPO, run_dlaunch
from tests.synthetic import write_run
from tests.unit.test_tune import cand

OK, FAILED, SKIPPED = "1-ddp-fp32-mb8", "2-ddp-fp32-ckpt-mb8", "3-ddp-bf16-mb8"


def write_tune(root: Path) -> Path:
    """A tune of three candidates: one measured (0.1 s/step, 160 samples/s on 2 ranks), one
    crashed (its run dir holds only its console), one skipped by the budget (no run dir)."""
    base = LaunchSpec(workload=str(REPO / "workloads" / "mlp.py"), run_id="tune-x", run_dir=str(root),
                      gpus=2, steps=6)
    root.mkdir()
    write_run(root / OK, world_size=2, step_s=0.1, micro_batch=8)
    (root / FAILED).mkdir()
    RunPaths(root=root / FAILED).console_log.write_text("rank 1: RuntimeError: injected failure\n")
    trials = [Trial(name="DDP fp32, mb 8 x 1", candidate=cand(step_s=0.01), run_dir=str(root / OK),
                    status="ok", measured_step_s=0.1, measured_samples_per_s=160.0),
              Trial(name="DDP fp32 + ckpt, mb 8 x 1", candidate=cand(ckpt=True, step_s=0.011),
                    run_dir=str(root / FAILED), status="failed",
                    reason="rank 1 (host n2): RuntimeError: injected failure"),
              Trial(name="DDP bf16, mb 8 x 1", candidate=cand(precision="bf16", step_s=0.012),
                    run_dir=str(root / SKIPPED), status="skipped", reason="--budget-min reached (1 min)")]
    finish(base, trials, workload="workloads/mlp.py", workload_args=())
    return root


@pytest.fixture(scope="module")
def tune_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = write_tune(tmp_path_factory.mktemp("tune") / "t")
    render_report(root / OK, formats={"html"}, with_prediction=False)  # the trial's own report
    render_report(root, formats={"html", "md", "json"})
    return root, TunePaths(root=root).report


def test_the_report_json_holds_the_tune_table_with_nothing_made_up(tune_report):
    root, out = tune_report
    data = json.loads((out / "report.json").read_text())
    assert data["kind"] == "tune" and data["rows"] == []
    tune = data["tune"]
    assert tune["tuned_plan"] == str(TunePaths(root=root).tuned_plan) and tune["workload"] == "workloads/mlp.py"
    ok, failed, skipped = tune["trials"]
    assert (ok["run_name"], ok["status"], ok["chosen"]) == (OK, "ok", True)
    assert ok["step_ratio"] == pytest.approx(0.1 / 0.01)
    assert ok["predicted_samples_per_s"] == pytest.approx(8 * 2 / 0.01)
    for t in (failed, skipped):
        assert not t["chosen"] and t["measured_step_s"] is None and t["measured_samples_per_s"] is None
        assert t["step_ratio"] is None
    assert "injected failure" in failed["reason"] and skipped["reason"].startswith("--budget-min")
    assert skipped["run_dir"] is None and failed["run_dir"] == str(root / FAILED)
    assert ok["report_html"] == str(RunPaths(root=root / OK).report / "report.html")
    assert failed["report_html"] is None
    # every trial is a point of the page too, the skipped one without a run
    assert [(p["name"], p["status"]) for p in data["points"]] == [
        (OK, "ok"), (FAILED, "failed"), (SKIPPED, "skipped")]


def test_the_page_shows_the_table_reasons_plan_and_links(tune_report):
    root, out = tune_report
    page = (out / "report.html").read_text()
    table = page[page.index('<table id="tune">'):page.index("</table>", page.index('<table id="tune">'))]
    rows = table.split("<tr")[2:]  # after the header row
    assert len(rows) == 3
    assert rows[0].startswith(' class="chosen">') and f'href="../{OK}"' in rows[0]
    assert f'href="../{OK}/report/report.html"' in rows[0] and "<td>160.0</td>" in rows[0]
    assert "<td>10.00</td>" in rows[0]  # measured/predicted step time
    # measured cells of trials that measured nothing say so
    for row, status in ((rows[1], "failed"), (rows[2], "skipped")):
        cells = row.split("<td>")[1:]
        assert status in cells[1] and [c.split("</td>")[0] for c in cells[4:7]] == ["-", "-", "-"]
    assert f'href="../{FAILED}"' in rows[1] and f"dlaunch report {root / FAILED}" in rows[1]
    assert "href" not in rows[2]  # a skipped trial has no run dir to link
    outcome = page[page.index('id="tune-outcome"'):]
    assert "FAILED: DDP fp32 + ckpt, mb 8 x 1 (2-ddp-fp32-ckpt-mb8): rank 1 (host n2): RuntimeError" in outcome
    assert "SKIPPED: DDP bf16, mb 8 x 1 (3-ddp-bf16-mb8): --budget-min reached (1 min)" in outcome
    assert f"dlaunch run workloads/mlp.py --plan {TunePaths(root=root).tuned_plan}" in outcome
    assert 'data-plot="predicted"' in page and 'data-plot="ranks"' in page
    assert 'data-plot="throughput"' not in page  # one world size: no scaling curve
    assert "dlaunch report: tune t" in page


def test_the_markdown_has_the_same_table(tune_report):
    root, out = tune_report
    md = (out / "report.md").read_text()
    assert "## Tune" in md
    assert (f"| DDP fp32, mb 8 x 1 | ok | 0.01 s | 1,600.0 | 0.1 s | 160.0 | 10.00 | yes | "
            f"[report](../{OK}/report/report.html) |") in md
    assert "| DDP bf16, mb 8 x 1 | skipped | 0.012 s | 1,333.3 | - | - | - |  | - |" in md
    assert "- SKIPPED: DDP bf16, mb 8 x 1 (3-ddp-bf16-mb8): --budget-min reached (1 min)" in md


def test_a_moved_tune_dir_still_finds_its_trials(tune_report, tmp_path: Path):
    root, _ = tune_report
    moved = tmp_path / "moved"
    shutil.copytree(root, moved)
    shutil.rmtree(moved / "report")
    _, rep = render_report(moved, formats={"json"})
    assert rep.tune is not None and rep.tune.trials[0].run_dir == str(moved / OK)
    assert rep.points[0].samples_per_s == pytest.approx(160.0)


def test_a_garbage_tune_record_is_named_and_the_trials_reported_as_runs(tmp_path: Path):
    root = write_tune(tmp_path / "t")
    TunePaths(root=root).record.write_text('{"trials": [{"name": 3}]}')
    _, rep = render_report(root, formats={"json"})
    assert rep.kind == "runs" and rep.tune is None
    assert any(n.startswith("tune.json: not a dlaunch tune record") for n in rep.notes)
    assert [p.name for p in rep.points] == [OK]


def test_report_cli_recognises_a_tune_dir(tmp_path: Path):
    root = write_tune(tmp_path / "t")
    done = run_dlaunch("report", str(root), "--format", "md,json")
    assert done.code == 0, done.err
    assert done.out.startswith(f"tune: {root}\n")
    assert f"  {OK}: ok; predicted 0.01 s/step, 1,600.0 samples/s; measured 0.1 s/step, 160.0 samples/s, " \
           "measured/predicted 10.00  <- chosen" in done.out
    assert f"  {SKIPPED}: skipped; predicted 0.012 s/step, 1,333.3 samples/s; not measured\n" in done.out
    # each trial that did not finish is named once, with its reason
    assert done.out.count("injected failure") == 1 and done.out.count("--budget-min reached") == 1, done.out


def _profile() -> ModelProfile:
    return ModelProfile(name="m", num_params=10**8, bytes_by_dtype={"float32": 4 * 10**8}, num_blocks=8,
                        largest_block_params=10**7, activation_bytes_per_sample=5e7,
                        block_input_bytes_per_sample=1e6, flops_fwd_per_sample=2e11, units_per_sample=128)


def test_a_trials_plan_json_predicts_its_own_candidate(tmp_path: Path):
    topo = load_topology("h100-sxm-8x").with_shape(num_nodes=1, devices_per_node=2)
    planned = Planned(plan=plan(_profile(), topo, Goal()), profile=_profile(), topology=topo)
    chosen = planned.plan.chosen
    decided = lambda c: (c.strategy.kind, c.strategy.precision, c.micro_batch, c.grad_accum)  # noqa: E731
    other = next((c for c in planned.plan.rejected if c.fits and decided(c) != decided(chosen)), None)
    assert other is not None
    base = LaunchSpec(workload="w.py", run_id="t", run_dir=str(tmp_path), device="cuda", gpus=2)
    spec = trial_spec(base, other, 2)
    write_plan(tmp_path, trial_planned(planned, other))
    written = json.loads(RunPaths(root=tmp_path).plan.read_text())
    assert written["plan"]["chosen"]["strategy"] == dataclasses.asdict(other.strategy)
    assert written["plan"]["units_per_s"] == pytest.approx(
        other.micro_batch * other.grad_accum * 2 * 128 / other.time.step_time_s)
    block = compare(written, spec, step_time_s=0.5, peak_mem_bytes=None, device="cuda")
    assert block["available"] and block["step_time_s"] == pytest.approx(other.time.step_time_s)
    # the base run's plan.json would not describe this trial: the prediction says so
    write_plan(tmp_path, planned)
    assert not compare(json.loads(RunPaths(root=tmp_path).plan.read_text()), spec, step_time_s=0.5,
                       peak_mem_bytes=None, device="cuda")["available"]

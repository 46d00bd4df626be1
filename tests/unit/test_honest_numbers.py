"""No number shown that was not measured, and numbers that look wrong say so: live tensor bytes
beside RSS on CPU, "not measured" instead of 0, "ok, no steps reported", host load and the
plausibility warnings, one source for the verdict card and the table, report file modes,
NICs without a speed."""

from __future__ import annotations

import html
import json
import os
import re
from collections import namedtuple

import pytest

from launcher.drivers.sweeppoints import point_name
from launcher.hardware.detect import unknown_speed_nics
from launcher.report.html import page, run_table, verdict_cards
from launcher.report.render import summary_lines, write_report
from launcher.report.scaling import build_report
from launcher.results.aggregate import aggregate
from launcher.results.misfits import find_misfit
from launcher.results.plausibility import host_load
from launcher.results.table import format_run
from launcher.results.verdict import NOT_MEASURED, NOT_MEASURED_COMM
from launcher.rundir import RunPaths, SweepPaths
from launcher.specs import GIB

from tests.synthetic import write_run, write_sweep
from tests.unit.test_results import add_live_bytes, write_plan


def as_script(run_dir, *, drop_steps: bool = False):
    """Turn a synthetic run into what a plain torchrun script leaves behind."""
    paths = RunPaths(root=run_dir)
    spec = json.loads(paths.launch.read_text())
    paths.launch.write_text(json.dumps({**spec, "is_script": True}))
    paths.result.unlink()  # the report aggregates the files again
    for rank in range(spec["gpus"] * spec["nodes"]):
        if drop_steps:
            paths.records(rank).unlink()
            paths.summary(rank).unlink()
    return run_dir


def table_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if re.match(r"^(\d+|all)\s", line)]


# --- 5: live tensor bytes beside RSS -----------------------------------------------------------

def test_cpu_summary_shows_live_tensors_beside_rss_and_the_plan(tmp_path):
    run = write_run(tmp_path / "r", world_size=2)  # RSS 2**28 = 0.25 GiB on every step
    add_live_bytes(run, {0: GIB // 16, 1: GIB // 8})
    write_plan(run)
    res = aggregate(run)
    assert [r.live_peak_bytes for r in res.ranks] == [GIB // 16, GIB // 8]
    assert res.ranks[1].live_peak_step == 2
    text = format_run(res)
    header = next(line for line in text.splitlines() if line.startswith("rank"))
    assert "tensors peak" in header and "RSS peak" in header and "peak mem" not in header
    assert "0.12 GiB" in table_rows(text)[1] and "0.25 GiB" in table_rows(text)[1]
    [mem] = [line for line in text.splitlines() if line.startswith("memory")]
    assert "0.12 GiB live tensors" in mem and "RSS 0.25 GiB" in mem
    assert "the plan estimated 0.50 GiB per rank" in mem
    # the plan is compared with the tensors, never the process
    assert res.prediction["measured_mem_gib"] == pytest.approx(0.125)


def test_without_live_bytes_cpu_memory_is_not_measured_rather_than_rss(tmp_path):
    run = write_run(tmp_path / "r", world_size=2)
    write_plan(run)
    res = aggregate(run)
    assert res.prediction["measured_mem_gib"] is None and res.prediction["mem_ratio"] is None
    assert "live tensor bytes not measured" in format_run(res)


def test_the_sampler_counts_one_real_step_and_keeps_the_record_layout():
    import torch

    from launcher.runtime.live_bytes import StepSampler

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    params = sum(p.numel() * 4 for p in model.parameters())

    def step():
        model(torch.randn(32, 64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    sampler = StepSampler.for_rank(device_type="cpu", start=0, warmup_steps=3, steps=10,
                                   module=model, optimizer=opt)
    assert sampler.step == 3
    records = []
    for n in range(1, 5):
        sampler.begin(n)
        step()
        rec = {"kind": "step", "step": n, "warmup": n <= 3}
        sampler.end(n, rec)
        records.append(rec)
    assert [("live_peak_bytes" in r) for r in records] == [False, False, True, False]
    peak = records[2]["live_peak_bytes"]
    # parameters + AdamW's two moments + gradients at least, and not wildly more
    assert 4 * params <= peak < 4 * params + 2_000_000
    assert list(records[2])[-1] == "warmup"  # report.runs reads "warmup" before "step_time_s"


@pytest.mark.parametrize("kw", [dict(device_type="cuda"), dict(warmup_steps=1)])
def test_the_sampler_stays_off_where_it_cannot_see_the_tensors(kw):
    import torch

    from launcher.runtime.live_bytes import StepSampler

    model = torch.nn.Linear(2, 2)
    args = dict(device_type="cpu", start=0, warmup_steps=3, steps=10, module=model,
                optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert StepSampler.for_rank(**{**args, **kw}).step is None


# --- 6 and 7: not measured is not 0; no steps is not plain OK ---------------------------------

def test_a_plain_script_gets_no_made_up_verdict(tmp_path):
    res = aggregate(as_script(write_run(tmp_path / "r", world_size=2, data_wait_s=0.0)))
    assert res.verdict["name"] == NOT_MEASURED
    text = format_run(res)
    assert "compute is" not in text and "data wait 0%" not in text
    assert "verdict: not measured: a plain script" in text
    assert not any("%" in row for row in table_rows(text))  # data wait, the one % column
    point = build_report(tmp_path / "r", with_prediction=False).points[0]
    assert point.verdict["name"] == NOT_MEASURED and point.shares == {} and point.breakdown_s == {}
    assert "compute is" not in page(build_report(tmp_path / "r", with_prediction=False), [])


def test_a_script_that_reports_no_steps_shows_dashes_and_says_so(tmp_path):
    res = aggregate(as_script(write_run(tmp_path / "r", world_size=2), drop_steps=True), exit_code=0)
    assert res.status == "ok"
    text = format_run(res)
    head = text.splitlines()[0]
    assert "OK, NO STEPS REPORTED" in head
    for row in table_rows(text):
        assert "0.0 " not in row + " " and "0.000s" not in row and "?" not in row, row
    assert "ok, no steps reported" in table_rows(text)[-1]
    RunPaths(root=tmp_path / "r").result.write_text(json.dumps(res.to_dict()))
    rep = build_report(tmp_path / "r", with_prediction=False)
    assert "ok, no steps reported" in run_table(rep) and "ok, no steps reported" in verdict_cards(rep)


def test_a_multi_rank_run_without_the_calibration_does_not_claim_compute_bound(tmp_path):
    res = aggregate(write_run(tmp_path / "r", world_size=2))  # no comm record
    assert res.verdict["name"] == NOT_MEASURED_COMM
    assert "exposed communication not measured" in res.verdict["evidence"]
    point = build_report(tmp_path / "r", with_prediction=False).points[0]
    assert point.verdict["name"] == NOT_MEASURED_COMM


# --- 9: host load and plausibility warnings -----------------------------------------------------

def add_host_load(run_dir, *, start: dict, end: dict, ranks: int = 2) -> None:
    for rank in range(ranks):
        path = RunPaths(root=run_dir).records(rank)
        lines = [json.loads(x) for x in path.read_text().splitlines()]
        for rec in lines:
            if rec["kind"] in ("start", "end"):
                rec["host_load"] = start if rec["kind"] == "start" else end
        path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_host_load_lands_in_the_result_and_a_busy_host_warns(tmp_path):
    run = write_run(tmp_path / "r", world_size=2)
    add_host_load(run, start={"load_1m": 5.2, "usable_cores": 2, "steal_ticks": 100, "total_ticks": 1000},
                  end={"load_1m": 1.0, "usable_cores": 2, "steal_ticks": 200, "total_ticks": 2000})
    res = aggregate(run)
    [h] = res.host_load
    assert h["host"] == "node0" and h["load_1m_start"] == 5.2 and h["load_1m_end"] == 1.0
    assert h["steal_share"] == pytest.approx(0.1)
    warnings = [line for line in format_run(res).splitlines() if line.startswith("WARNING: busy host")]
    assert len(warnings) == 2  # load 5.2 > 2 cores; steal 10% > 5%
    assert "load average 5.2 > 2 usable core(s)" in warnings[0] and "steal 10%" in warnings[1]
    assert json.loads(json.dumps(res.to_dict()))["host_load"][0]["steal_share"] == pytest.approx(0.1)


def test_an_idle_host_and_steady_steps_raise_no_warning(tmp_path):
    run = write_run(tmp_path / "r", world_size=2, jitter=0.1)
    add_host_load(run, start={"load_1m": 0.3, "usable_cores": 2, "steal_ticks": 0, "total_ticks": 1000},
                  end={"load_1m": 1.9, "usable_cores": 2, "steal_ticks": 10, "total_ticks": 2000})
    assert aggregate(run).warnings == ()


def test_the_recorder_writes_host_load_at_start_and_end(tmp_path):
    from launcher.runtime.recorder import RankRecorder

    rec = RankRecorder(tmp_path, 0, {"host": "h", "local_rank": 0, "node_rank": 0})
    rec.finish("ok")
    records = [json.loads(x) for x in RunPaths(root=tmp_path).records(0).read_text().splitlines()]
    [(start, end)] = [(records[0], records[-1])]
    for r in (start, end):
        assert r["host_load"]["load_1m"] >= 0 and r["host_load"]["usable_cores"] >= 1
        assert r["host_load"]["total_ticks"] >= r["host_load"]["steal_ticks"] >= 0
    [h] = host_load({0: records})
    assert h["host"] == "h" and h["load_1m_start"] == start["host_load"]["load_1m"]
    # no tick may pass between the two records: no share then, never a division by zero
    assert h["steal_share"] is None or 0 <= h["steal_share"] <= 1


def test_noisy_steps_and_a_missed_prediction_warn(tmp_path):
    run = write_run(tmp_path / "r", world_size=2, step_s=0.5, slow={})
    path = RunPaths(root=run).records(1)
    # rank 1: every third steady step takes 3x as long -> p90 / median = 3
    text = path.read_text()
    for s in range(3, 21, 3):
        text = re.sub(rf'("step":{s},.*?"step_time_s":)0\.5', r"\g<1>1.5", text)
    path.write_text(text)
    write_plan(run)  # predicted 0.1 s: measured 0.5 s is 5x
    out = format_run(aggregate(run))
    assert "WARNING: noisy steps on rank(s) 1: p90 step 1.500 s is 3.0x the median 0.500 s" in out
    assert "WARNING: prediction missed: measured step time is 5.00x the plan's" in out


def test_superlinear_efficiency_warns_in_the_summary_and_the_report(tmp_path):
    # 1 rank at 0.5 s per step, 2 ranks at 0.1 s: weak efficiency 500%
    sweep = write_sweep(tmp_path / "s", {1: dict(step_s=0.5), 2: dict(step_s=0.1, exposed_comm_s=0.01)})
    rep = build_report(sweep, with_prediction=False)
    [warning] = [w for w in rep.warnings if w.startswith("superlinear")]
    assert "2 rank(s) at 500% efficiency relative to 1 rank(s)" in warning
    assert any(line.strip() == f"WARNING: {warning}" for line in summary_lines(rep))
    assert f"WARNING: {html.escape(warning)}" in page(rep, [])


def test_a_predicted_superlinear_scaling_warns_too(tmp_path):
    # the 1-rank point planned at 0.5 s a step (say, from a probe on a busy host), the 2-rank one at 0.05 s
    sweep = write_sweep(tmp_path / "s", {1: dict(step_s=0.1), 2: dict(step_s=0.1)})
    for n, compute_s in ((1, 0.5), (2, 0.05)):
        run = SweepPaths(root=sweep).point(point_name(n, 0)).root
        write_plan(run, world_size=n, compute_s=compute_s, exposed_s=0.0)
        plan = json.loads(RunPaths(root=run).plan.read_text())
        plan["plan"]["units_per_s"] = 8 * n / compute_s  # micro-batch 8 a rank
        RunPaths(root=run).plan.write_text(json.dumps(plan))
    rep = build_report(sweep)
    [warning] = [w for w in rep.warnings if "superlinear" in w]
    assert warning.startswith("predicted superlinear scaling: 2 rank(s) at 1000% efficiency relative to 1 rank(s) "
                              "(> 200%)")


# --- 10: one source for the verdict, layout, file modes, NICs ----------------------------------

def test_the_verdict_card_and_the_table_show_the_same_compute_share(tmp_path):
    # step 0.1 s, sync-off forward+backward 0.05 s, exposed 0.01 s: other (optimizer) 0.04 s,
    # compute 0.05 s = 50% (not the 90% that 1 - wait - exposed would say)
    write_run(tmp_path / "r", world_size=2, exposed_comm_s=0.01, nosync_step_s=0.05)
    res = aggregate(tmp_path / "r")
    assert res.verdict["shares"]["compute"] == pytest.approx(0.5)
    assert "compute is 50% of the step, optimizer and host overhead 40%" in res.verdict["evidence"]
    point = build_report(tmp_path / "r", with_prediction=False).points[0]
    assert point.shares["compute"] == pytest.approx(0.5)
    assert "compute is 50%" in point.verdict["evidence"]
    assert "compute is 50%" in verdict_cards(build_report(tmp_path / "r", with_prediction=False))


def test_report_files_are_readable_by_group_and_others_whatever_the_umask(tmp_path):
    run = write_run(tmp_path / "r", world_size=2, exposed_comm_s=0.01)
    old = os.umask(0o077)
    try:
        files = write_report(run, with_prediction=False)
    finally:
        os.umask(old)
    assert {f.suffix for f in files} == {".html", ".png", ".json", ".md"}
    assert {oct(f.stat().st_mode & 0o777) for f in files} == {oct(0o644)}


def test_the_breakdown_figure_has_an_x_label_and_its_legend_off_the_bars(tmp_path):
    from launcher.report.plots import breakdown_figure

    sweep = write_sweep(tmp_path / "s", {1: dict(step_s=0.1), 2: dict(step_s=0.1, exposed_comm_s=0.05)})
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = breakdown_figure(build_report(sweep, with_prediction=False))
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    ax = fig.axes[0]
    assert ax.get_xlabel()
    legend = ax.get_legend().get_window_extent(renderer)
    labels = [t.get_window_extent(renderer) for t in ax.texts]
    assert labels and not any(legend.overlaps(b) for b in labels)


Stats = namedtuple("Stats", "isup speed")


def test_an_up_interface_without_a_speed_is_listed_as_unknown(monkeypatch):
    stats = {"eth0": Stats(True, 0), "eth1": Stats(True, 10000), "lo": Stats(True, 0),
             "eth2": Stats(False, 0), "docker0": Stats(True, 0)}
    assert unknown_speed_nics(stats) == ("eth0",)
    from launcher.hardware import view
    from launcher.hardware.detect import detect_topology

    monkeypatch.setattr(view, "unknown_speed_nics", lambda: ("eth0",))
    text = view.format_topology(detect_topology(device="cpu"), env={})
    [nics] = [line for line in text.splitlines() if line.startswith("NICs")]
    assert "ethernet speed unknown (eth0)" in nics
    assert "(assumed, not measured here)" in next(x for x in text.splitlines() if x.startswith("Intra-node"))


def test_misfits_are_recognised_from_the_error_text():
    assert find_misfit(["RuntimeError: Distributed package doesn't have NCCL built in"]).name == "NCCL without CUDA"
    assert find_misfit(["AttributeError: module 'torch._C' has no attribute '_cuda_setDevice'"]).name \
        == "CUDA device without a GPU"
    assert find_misfit(["ValueError: DistributedDataParallel device_ids and output_device arguments "
                        "only work with single-device/multiple-device GPU modules"]).name == "device_ids on CPU DDP"
    assert find_misfit(["ZeroDivisionError: division by zero", None]) is None

"""Report numbers on synthetic rank files: efficiency, breakdown, busbw and stragglers are
checked against values computed by hand from the step times written."""

from __future__ import annotations

import json
import os
import time

import pytest

from launcher.backends.base import parse_world_sizes
from launcher.drivers.sweep import check_plan, point_batch
from launcher.errors import DlaunchError, UsageError
from launcher.hardware.topology import load_topology
from launcher.report.render import parse_formats, render_report, write_report
from launcher.report.scaling import build_report
from launcher.results.table import format_run
from launcher.results.types import RunResult
from launcher.results.verdict import STRAGGLER_THRESHOLD, detect_stragglers, verdict
from launcher.rundir import RunPaths, SweepPaths

from tests.helpers import REPO, WORKLOADS, assert_one_line_error, run_dlaunch, run_result
from tests.synthetic import write_run, write_sweep


def rows(report):
    return {r.world_size: r for r in report.rows}


def test_weak_efficiency_by_hand(tmp_path):
    # micro-batch 8 per rank; steps of 0.1 / 0.125 / 0.2 s
    # throughput: 8/0.1 = 80; 2*8/0.125 = 128; 4*8/0.2 = 160 samples/s
    # efficiency: 128/(2*80) = 0.8; 160/(4*80) = 0.5
    write_sweep(tmp_path / "s", {1: dict(step_s=0.1), 2: dict(step_s=0.125),
                                 4: dict(step_s=0.2)}, mode="weak")
    rep = build_report(tmp_path / "s", with_prediction=False)
    r = rows(rep)
    assert rep.mode == "weak" and rep.baseline_world_size == 1
    assert r[1].samples_per_s == pytest.approx(80)
    assert r[2].samples_per_s == pytest.approx(128)
    assert r[4].samples_per_s == pytest.approx(160)
    assert r[1].efficiency == pytest.approx(1.0)
    assert r[2].efficiency == pytest.approx(0.8)
    assert r[4].efficiency == pytest.approx(0.5)
    assert r[4].ideal_samples_per_s == pytest.approx(320)


def test_strong_efficiency_by_hand(tmp_path):
    # global batch 16: micro 16 / 8 / 4; T = 0.2 / 0.125 / 0.08 s
    # efficiency T(1)/(N T(N)): 0.2/(2*0.125) = 0.8; 0.2/(4*0.08) = 0.625
    write_sweep(tmp_path / "s", {1: dict(step_s=0.2, micro_batch=16),
                                 2: dict(step_s=0.125, micro_batch=8),
                                 4: dict(step_s=0.08, micro_batch=4)}, mode="strong")
    r = rows(build_report(tmp_path / "s", with_prediction=False))
    assert r[2].efficiency == pytest.approx(0.8)
    assert r[4].efficiency == pytest.approx(0.625)
    # the same numbers from throughput: 16/0.125 = 128 vs 2 x 80
    assert r[2].samples_per_s == pytest.approx(128)


def test_efficiency_relative_to_smallest_world_size(tmp_path):
    # no 1-rank point: N0 = 2; 2 ranks 0.1 s -> 160/s, 8 ranks 0.16 s -> 400/s
    # efficiency = 400 / (8/2 x 160) = 0.625
    write_sweep(tmp_path / "s", {2: dict(step_s=0.1), 8: dict(step_s=0.16)})
    rep = build_report(tmp_path / "s", with_prediction=False)
    assert rep.baseline_world_size == 2
    assert rows(rep)[8].efficiency == pytest.approx(0.625)


def test_breakdown_busbw_and_link_by_hand(tmp_path):
    # step 0.125 = wait 0.01 + exposed 0.025 + other (0.125 - 0.01 - 0.025 - 0.05 = 0.04)
    #            + compute (the rest, 0.05 = the sync-off forward+backward)
    # busbw: median of 0.4 and 0.6 = 0.5 GB/s; cpu-local's shm link is 0.5 GB/s -> 100%
    topo = load_topology(str(REPO / "topologies" / "cpu-local.yaml"))
    write_sweep(tmp_path / "s", {2: dict(step_s=0.125, data_wait_s=0.01, exposed_comm_s=0.025,
                                         nosync_step_s=0.05, busbw_by_rank={0: 0.4, 1: 0.6})})
    rep = build_report(tmp_path / "s", topology=topo, with_prediction=False)
    p = rep.points[0]
    assert p.breakdown_s["data_wait"] == pytest.approx(0.01)
    assert p.breakdown_s["exposed_comm"] == pytest.approx(0.025)
    assert p.breakdown_s["other"] == pytest.approx(0.04)
    assert p.breakdown_s["compute"] == pytest.approx(0.05)
    assert sum(p.shares.values()) == pytest.approx(1.0)
    assert p.shares["exposed_comm"] == pytest.approx(0.2)
    assert p.busbw_gb_s == pytest.approx(0.5)
    assert (p.link_kind, p.link_bw_gb_s) == ("shm", 0.5)
    assert p.busbw_of_link == pytest.approx(1.0)


def test_busbw_above_the_links_figure_is_no_share_of_it(tmp_path):
    # 0.83 GB/s measured against cpu-local's assumed 0.5 GB/s: 166% would say the link is faster
    # than the physics allows; the report says the figure is wrong instead
    topo = load_topology(str(REPO / "topologies" / "cpu-local.yaml"))
    write_sweep(tmp_path / "s", {2: dict(exposed_comm_s=0.01, busbw_gb_s=0.83)})
    p = build_report(tmp_path / "s", topology=topo, with_prediction=False).points[0]
    assert p.busbw_gb_s == pytest.approx(0.83) and p.busbw_of_link is None
    assert any("exceeds the topology's shm figure of 0.5 GB/s" in w for w in p.warnings), p.warnings


def test_link_is_the_slowest_the_ring_crosses(tmp_path):
    topo = load_topology(str(REPO / "topologies" / "h100-sxm-8x4node-ib.yaml"))
    write_sweep(tmp_path / "s", {8: dict(exposed_comm_s=0.01, busbw_gb_s=400.0),
                                 16: dict(exposed_comm_s=0.01, busbw_gb_s=40.0,
                                          ranks_per_node=8)})
    rep = build_report(tmp_path / "s", topology=topo, with_prediction=False)
    by = {p.world_size: p for p in rep.points}
    assert by[8].link_kind == topo.intra_node.kind
    assert by[16].link_kind == topo.inter_node.kind
    assert by[16].busbw_of_link == pytest.approx(40.0 / topo.inter_node.bw_gb_s)


def straggler_lines(run_dir) -> list[str]:
    """The run summary's STRAGGLER lines, from the result the synthetic run aggregated."""
    result = RunResult.from_dict(run_result(run_dir))
    return [line for line in format_run(result).splitlines() if line.startswith("STRAGGLER")]


def test_straggler_by_step_time(tmp_path):
    # rank 3 at 1.3x: median of medians 0.1, 0.13 > 0.11 -> straggler; 1.05x is not
    write_run(tmp_path / "r", world_size=4, slow={3: 1.3, 1: 1.05})
    rep = build_report(tmp_path / "r", with_prediction=False)
    p = rep.points[0]
    assert [s["rank"] for s in p.stragglers] == [3]
    assert p.stragglers[0]["signal"].startswith("step time: median step 0.130 s vs 0.103 s")
    # the summary prints the numbers that fired the rule: 0.13 vs the median of
    # (0.1, 0.1, 0.105, 0.13) = 0.1025, +27%
    assert straggler_lines(tmp_path / "r") == [
        "STRAGGLER: rank 3 on node0 (local rank 3), by step time: median step 0.130 s vs 0.103 s "
        "median of rank medians (+27%; the flag needs > +10% and > +1 ms)"]
    groups = {g["label"]: g for g in p.distribution["groups"]}
    assert groups["3"]["straggler"] and not groups["1"]["straggler"]
    assert groups["3"]["p50"] == pytest.approx(0.13)
    # the same shares at a tenth of a millisecond are jitter, not a straggler
    write_run(tmp_path / "fast", world_size=4, step_s=1e-4, slow={3: 1.3, 1: 1.05})
    assert build_report(tmp_path / "fast", with_prediction=False).points[0].stragglers == []


def test_straggler_by_own_compute_under_ddp(tmp_path):
    # DDP: every rank's step ends in the all-reduce, so step times are equal; the slow rank
    # shows in its sync-off forward+backward (51 ms vs 1 ms)
    write_run(tmp_path / "r", world_size=2, exposed_comm_s=0.05,
              nosync_by_rank={0: 0.001, 1: 0.051})
    rep = build_report(tmp_path / "r", with_prediction=False)
    p = rep.points[0]
    assert [s["rank"] for s in p.stragglers] == [1]
    assert "sync-off" in p.stragglers[0]["signal"]
    assert "straggler rank(s) 1" in p.verdict["evidence"]
    # median over the two ranks: (1 + 51) / 2 = 26 ms; the step times (equal) are shown too
    [line] = straggler_lines(tmp_path / "r")
    assert line.startswith("STRAGGLER: rank 1 on node0 (local rank 1), by own compute: own "
                           "forward+backward with gradient sync off 51.0 ms vs 26.0 ms median"), line
    assert "+96%" in line and "its median step 0.100 s vs 0.100 s" in line


def test_even_run_flags_no_rank(tmp_path):
    # +-5% jitter on every rank, equal calibrations: nobody is slow
    write_run(tmp_path / "r", world_size=8, jitter=0.1, exposed_comm_s=0.01, nosync_step_s=0.05)
    result = run_result(tmp_path / "r")
    assert result["stragglers"] == [] and result["straggler_evidence"] == []
    assert straggler_lines(tmp_path / "r") == []
    assert build_report(tmp_path / "r", with_prediction=False).points[0].stragglers == []


@pytest.mark.parametrize("kw", [
    # one rank twice as fast: far from the median, but faster
    dict(world_size=4, slow={0: 0.5}),
    dict(world_size=2, slow={0: 0.7}),
    # the calibration says rank 0 is slow (200 vs 150 ms) but its median step over the run is
    # 3.4% below the median of medians (0.371 vs 0.384 s): the steady steps win, no flag
    dict(world_size=2, step_s=0.384, slow={0: 0.371 / 0.384, 1: 0.397 / 0.384},
         exposed_comm_s=0.01, nosync_by_rank={0: 0.2, 1: 0.15}),
])
def test_a_faster_rank_is_never_flagged(tmp_path, kw):
    write_run(tmp_path / "r", **kw)
    result = run_result(tmp_path / "r")
    assert 0 not in result["stragglers"]
    assert not any("rank 0 " in line for line in straggler_lines(tmp_path / "r"))
    assert 0 not in [s["rank"] for s in build_report(tmp_path / "r", with_prediction=False).points[0].stragglers]


def test_flagged_ranks_are_always_above_the_median():
    # every straggler either rule flags is slower than the median it names
    cases = [{0: 0.1, 1: 0.2}, {0: 0.3, 1: 0.1, 2: 0.1}, {0: 0.05, 1: 0.1, 2: 0.1, 3: 0.1},
             {r: 0.1 + 0.01 * r for r in range(16)}]
    for medians in cases:
        for busy in (None, {r: 2 * t for r, t in medians.items()}):
            for s in detect_stragglers(medians, busy):
                assert s.rank_s > s.median_s * (1 + STRAGGLER_THRESHOLD), (medians, s)


def test_a_rank_slow_in_its_own_compute_is_flagged_though_its_step_reads_a_little_faster():
    # DDP on a loaded host (a real run): rank 1 sleeps 50 ms in every forward; its sync-off pass says
    # 51.5 ms against rank 0's 1.2 ms, while its median step reads 2.2% below the median of medians
    # (its work between steps hides in rank 0's wait): far less than its 25 ms excess, so flagged
    [s] = detect_stragglers({0: 0.0559, 1: 0.0535}, {0: 0.00117, 1: 0.0515})
    assert s.rank == 1 and s.rule == "own compute"


def test_sub_millisecond_calibration_jitter_is_not_a_straggler(tmp_path):
    write_run(tmp_path / "r", world_size=2, exposed_comm_s=0.001,
              nosync_by_rank={0: 0.0008, 1: 0.0012})
    assert build_report(tmp_path / "r", with_prediction=False).points[0].stragglers == []


@pytest.mark.parametrize("shares,name", [
    ({"data_wait": 0.21, "exposed_comm": 0.5, "compute": 0.29}, "data-loading bound"),
    ({"data_wait": 0.20, "exposed_comm": 0.26, "compute": 0.54}, "communication bound"),
    ({"data_wait": 0.1, "exposed_comm": 0.25, "compute": 0.65}, "compute bound"),
])
def test_verdict_rule(shares, name):
    got, evidence = verdict(shares)
    assert got == name and "%" in evidence


def test_verdict_from_result_json_wins(tmp_path):
    write_run(tmp_path / "r", world_size=2, exposed_comm_s=0.09,
              verdict={"name": "launch bound", "evidence": "GPU idle 40% between kernels"})
    v = build_report(tmp_path / "r", with_prediction=False).points[0].verdict
    assert v == {"name": "launch bound", "evidence": "GPU idle 40% between kernels", "source": "run"}


def test_repeats_take_the_median(tmp_path):
    d = tmp_path / "runs"
    for i, s in enumerate((0.1, 0.2, 0.125)):  # 80, 40, 64 samples/s
        write_run(d / f"a{i}", world_size=1, step_s=s)
    rep = build_report(d, with_prediction=False)
    r = rows(rep)[1]
    assert rep.kind == "runs" and r.repeats == 3
    assert (r.samples_per_s, r.samples_per_s_min, r.samples_per_s_max) == pytest.approx((64, 40, 80))


def test_a_directory_of_runs_of_several_workloads_draws_the_newest_runs_workloads_curve(tmp_path):
    d = tmp_path / "runs"
    for n in (1, 2):
        write_run(d / f"gpt{n}", world_size=n, step_s=0.1, workload="/w/gpt.py")
    write_run(d / "mlp2", world_size=2, step_s=0.4, workload="/w/mlp.py")
    RunPaths(root=write_run(d / "old", world_size=2, step_s=0.4)).launch.unlink()  # its result.json alone
    later = time.time() + 5
    os.utime(RunPaths(root=d / "gpt2").launch, (later, later))  # the newest run
    rep = build_report(d, with_prediction=False)
    assert [p.name for p in rep.points] == ["gpt1", "gpt2"]
    assert rows(rep)[2].efficiency == pytest.approx(1.0)  # not mixed with mlp's 4x slower steps
    assert rep.notes == ["left out 2 run(s) of other workloads (mlp.py: 1, unknown (launch.json unread): 1): the "
                         "curve is the newest run's workload's (gpt.py); report a directory of the others' runs "
                         "for theirs"]


def test_truncated_and_missing_rank_files_are_named(tmp_path):
    run = write_run(tmp_path / "r", world_size=3, steps=10)
    f = RunPaths(root=run).records(1)
    f.write_bytes(f.read_bytes()[:-30])  # cut the last record in half
    later = time.time() + 5
    os.utime(f, (later, later))
    RunPaths(root=run).records(2).unlink()
    files, rep = render_report(run, formats={"html", "json", "md"}, with_prediction=False)
    notes = rep.points[0].unreadable
    assert any("rank-1.jsonl" in n and "cut off" in n for n in notes), notes
    assert any("rank-2.jsonl: missing" in n for n in notes), notes
    html = (run / "report" / "report.html").read_text()
    assert "rank-1.jsonl" in html and "rank-2.jsonl" in html
    # what was readable is still reported: rank 1's whole steps, rank 0 complete
    assert rep.points[0].distribution["groups"][0]["n"] == 8
    assert json.loads((run / "report" / "report.json").read_text())["points"][0]["unreadable"]


def test_no_runs_is_one_line_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DlaunchError, match="no runs in") as e:
        write_report(tmp_path / "empty")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("args,needle", [
    (["report", "{tmp}/empty"], "no runs in"),
    (["report", "{tmp}/nope"], "does not exist"),
    (["report", "{tmp}/empty", "--format", "html,pdf"], "--format 'pdf'"),
])
def test_report_bad_input_cli(tmp_path, args, needle):
    (tmp_path / "empty").mkdir()
    done = run_dlaunch(*(a.format(tmp=tmp_path) for a in args), timeout=120)
    assert_one_line_error(done, needle)


def test_parse_world_sizes():
    assert parse_world_sizes("4,1,2") == [1, 2, 4]
    for bad, needle in [("1,,2", "item 2 is empty"), ("0,2", ">= 1"), ("abc", "not an integer"),
                        ("1,2,2", "listed twice"), ("", "comma-separated"),
                        ("1,16", "more than the 8")]:
        with pytest.raises(UsageError, match=needle) as e:
            parse_world_sizes(bad, available=8)
        assert "\n" not in str(e.value)


def test_batches_per_mode():
    assert check_plan("weak", [1, 2, 4], micro_batch=8, global_batch=None) == {1: 8, 2: 8, 4: 8}
    assert check_plan("strong", [1, 2, 4], micro_batch=8, global_batch=16) == {1: 16, 2: 8, 4: 4}
    assert point_batch("strong", 2, micro_batch=1, global_batch=16, grad_accum=2) == 4
    with pytest.raises(UsageError, match="does not split over world size"):
        check_plan("strong", [1, 2, 3], micro_batch=8, global_batch=16)
    with pytest.raises(UsageError, match="--global-batch B"):
        check_plan("strong", [1, 2], micro_batch=8, global_batch=None)
    with pytest.raises(UsageError, match="applies to --mode strong"):
        check_plan("weak", [1, 2], micro_batch=8, global_batch=16)
    assert parse_formats("html, png") == {"html", "png"}


def test_prediction_is_optional_and_explained(tmp_path, monkeypatch):
    topo = load_topology(str(REPO / "topologies" / "cpu-local.yaml"))
    write_sweep(tmp_path / "s", {1: dict(workload=str(WORKLOADS / "mlp.py")),
                                 2: dict(workload=str(WORKLOADS / "mlp.py"), exposed_comm_s=0.01)})
    rep = build_report(tmp_path / "s", topology=topo)
    assert rep.prediction_note is None, rep.prediction_note
    assert all(r.predicted_step_time_s and r.predicted_step_time_s > 0 for r in rep.rows)
    assert rows(rep)[1].predicted_efficiency == pytest.approx(1.0)

    import launcher.report.predict

    def broken(*a, **k):
        raise RuntimeError("cost model not finished")

    monkeypatch.setattr(launcher.report.predict, "plan", broken)
    rep = build_report(tmp_path / "s", topology=topo)
    assert rep.prediction_note.startswith("prediction unavailable: RuntimeError: cost model")
    assert all(r.predicted_step_time_s is None for r in rep.rows)
    assert rows(rep)[2].efficiency is not None  # the measurement is untouched
    assert "no topology" in build_report(tmp_path / "s").prediction_note


def test_many_nodes_are_grouped_per_node(tmp_path):
    write_run(tmp_path / "r", world_size=256, steps=6, warmup=1, ranks_per_node=8,
              slow={77: 1.5}, result="direct")
    dist = build_report(tmp_path / "r", with_prediction=False).points[0].distribution
    assert dist["grouping"] == "node" and len(dist["groups"]) == 32
    flagged = [g["label"] for g in dist["groups"] if g["straggler"]]
    assert flagged == ["n9"]  # rank 77 lives on node 77 // 8


def test_4096_ranks_report_is_readable(tmp_path):
    run = write_run(tmp_path / "big", world_size=4096, steps=200, warmup=3, ranks_per_node=8,
                    jitter=0.2, exposed_comm_s=0.02, busbw_gb_s=40.0, slow={1234: 1.3},
                    result="direct")
    # how fast is benchmarks/report_scale.py's (the same render_report, and the whole command;
    # target < 10 s; docs/benchmarks.md): timed here it took 22.7 s at load 3-4 on the 2-core
    # AMD EPYC VM (2026-11-28), too close to any bound a loaded host keeps
    files, rep = render_report(run, with_prediction=False)
    dist = rep.points[0].distribution
    assert dist["grouping"] == "rank block" and len(dist["groups"]) <= 64
    assert [s["rank"] for s in rep.points[0].stragglers] == [1234]
    html = next(f for f in files if f.suffix == ".html")
    assert html.stat().st_size < 2_000_000
    assert "STRAGGLER" in html.read_text() and "1234" in html.read_text()


def test_other_record_layouts_and_a_bad_line_are_read_line_by_line(tmp_path):
    # the plain-script meter writes step_time_s before data_wait_s and has no "warmup" key
    run = write_run(tmp_path / "r", world_size=2, steps=6, warmup=0, step_s=0.1)
    meter = "".join(json.dumps({"kind": "step", "step": s, "time": 1.0 + s, "step_time_s": 0.3,
                                "data_wait_s": 0.0, "samples": 8, "units": 8, "loss": 1.0})
                    + "\n"
                    for s in range(1, 5))
    paths = RunPaths(root=run)
    paths.records(0).write_text('{"kind":"start","rank":0,"host":"h"}\n' + meter)
    lines = paths.records(1).read_text().splitlines(keepends=True)
    paths.records(1).write_text("".join(lines[:4] + ["{not json\n"] + lines[4:]))
    later = time.time() + 5
    for r in (0, 1):
        os.utime(paths.records(r), (later, later))
    p = build_report(run, with_prediction=False).points[0]
    groups = {g["label"]: g for g in p.distribution["groups"]}
    assert groups["0"]["n"] == 4 and groups["0"]["p50"] == pytest.approx(0.3)
    assert groups["1"]["n"] == 2  # the two steps before the bad line
    assert any("rank-1.jsonl: line 5 is not JSON" in n for n in p.unreadable), p.unreadable


def test_prediction_from_the_plan_the_run_followed(tmp_path):
    # plan.json (written by `dlaunch run` when it planned): step 0.05 + 0.01 s, 200 samples/s
    write_sweep(tmp_path / "s", {1: dict(step_s=0.1), 2: dict(step_s=0.125)})
    for n, (compute, exposed, rate) in {1: (0.05, 0.0, 160.0), 2: (0.05, 0.01, 240.0)}.items():
        SweepPaths(root=tmp_path / "s").point(f"ws{n}-r0").plan.write_text(json.dumps({
            "plan": {"chosen": {"time": {"compute_s": compute, "comm_total_s": exposed,
                                         "comm_exposed_s": exposed}}, "units_per_s": rate},
            "profile": {"units_per_sample": 1}, "topology": "t"}))
    rep = build_report(tmp_path / "s")  # no topology needed: every point has its plan
    assert rep.prediction_note is None
    r = rows(rep)
    assert r[2].predicted_step_time_s == pytest.approx(0.06)
    assert r[2].predicted_efficiency == pytest.approx(240 / (2 * 160))


def test_tensor_parallel_collectives_count_as_exposed_communication():
    from launcher.results.verdict import step_parts

    # a 1.0 s step: 0.1 s batch wait, 0.05 s data-parallel exposed, 0.75 s forward+backward with
    # sync off, of which 0.3 s inside TP's collectives (all exposed: no async TP)
    plain = step_parts(1.0, data_wait_share=0.1, exposed_comm_s=0.05, nosync_step_s=0.75)
    tp = step_parts(1.0, data_wait_share=0.1, exposed_comm_s=0.05, nosync_step_s=0.75, tp_comm_s=0.3)
    assert tp["exposed_comm"] == pytest.approx(0.35) and tp["compute"] == pytest.approx(plain["compute"] - 0.3)
    assert tp["other"] == pytest.approx(plain["other"]) and tp["data_wait"] == pytest.approx(0.1)
    assert verdict({k: v / tp["step"] for k, v in tp.items()})[0] == "communication bound"
    assert verdict({k: v / plain["step"] for k, v in plain.items()})[0] == "compute bound"
    # never more than the compute it was timed in
    assert step_parts(1.0, data_wait_share=0.0, exposed_comm_s=0.0, nosync_step_s=0.2, tp_comm_s=5.0)["compute"] == 0

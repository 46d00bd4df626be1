"""`dlaunch report` and the aggregation over run directories holding valid-JSON garbage, runs
whose launcher died (orphaned) or still lives (running), and rank files shared with another run:
one line or a clear note, never a traceback, and never a loop over a count a file claims."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.errors import DlaunchError, RunDirError
from launcher.report.render import render_report
from launcher.results.aggregate import aggregate
from launcher.results.types import RunResult
from launcher.rundir import RunPaths

from tests.helpers import assert_one_line_error, run_dlaunch
from tests.synthetic import write_run


def _run(tmp_path: Path, name: str = "r", world_size: int = 2) -> Path:
    return write_run(tmp_path / name, world_size=world_size, steps=6, warmup=1, result=None)


def _append(path: Path, *lines: str) -> None:
    path.write_text(path.read_text() + "".join(line + "\n" for line in lines))


def _launch(run: Path, **changes: object) -> None:
    path = RunPaths(root=run).launch
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _report(run: Path):
    return render_report(run, formats={"json", "md"}, with_prediction=False)[1].points[0]


@pytest.mark.parametrize("lines, needle", [
    (["null", "[1,2,3]"], "line 10: null, not a record"),
    (['{"kind":"step"}'], "step record without 'step'"),
    (['{"kind":"step","step":7,"step_time_s":"slow","samples":8,"units":8,"data_wait_s":0}'],
     "'step_time_s' expected a number, got the string 'slow'"),
    (['{"kind":"comm","exposed_comm_s":"x"}'], "'exposed_comm_s' expected"),
    (['{"kind":"end","host_load":{"total_ticks":"x"}}'], "'host_load'"),
])
def test_malformed_records_are_skipped_and_named(tmp_path, lines, needle):
    run = _run(tmp_path)
    _append(RunPaths(root=run).records(0), *lines)
    point = _report(run)
    notes = [n for n in point.unreadable if "rank-0.jsonl" in n and "malformed" in n]
    assert notes and needle in notes[0], point.unreadable
    res = aggregate(run)
    assert res.ranks[0].steps == 6 and any(needle in n for n in res.unreadable)


def test_a_bad_summary_is_a_note(tmp_path):
    run = _run(tmp_path)
    RunPaths(root=run).summary(1).write_text('{"status": 5}')
    res = aggregate(run)
    assert any("rank-1.summary.json: not a rank summary" in n for n in res.unreadable)
    assert res.ranks[1].status == "incomplete"


@pytest.mark.parametrize("launch, needle", [
    ("[]", "got a list"),
    ('{"workload": "w.py", "run_id": "r", "run_dir": ".", "nproc_per_node": "two"}',
     "'gpus': expected an integer, got the string 'two'"),  # an old name reads as the new
    ('{"workload": "w.py", "run_id": "r", "run_dir": ".", "strategy": 5}', "'strategy'"),
    ('{"workload": "w.py", "run_id": "r", "run_dir": ".", "num_nodes": 0}', "must be an integer >= 1, got 0"),
])
def test_a_launch_json_that_is_no_spec_is_one_line(tmp_path, launch, needle):
    run = _run(tmp_path)
    RunPaths(root=run).launch.write_text(launch)
    with pytest.raises(RunDirError, match="launch.json is not a launch spec") as e:
        aggregate(run)
    assert needle in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(DlaunchError, match="launch.json is not a launch spec"):
        render_report(run, formats={"json"}, with_prediction=False)
    done = run_dlaunch("report", str(run), "--format", "json", "--no-predict", timeout=60)
    assert_one_line_error(done, "launch.json is not a launch spec", needle)


@pytest.mark.parametrize("result, needle", [
    ("[1, 2]", "expected an object, got a list"),
    ('{"run_id": 5}', "not a dlaunch result"),
    ('{"ranks": "abc"}', "not a dlaunch result"),
])
def test_a_result_json_that_is_no_result_is_a_note(tmp_path, result, needle):
    run = _run(tmp_path)
    RunPaths(root=run).result.write_text(result)
    point = _report(run)
    assert point.status == "ok" and any(needle in n for n in point.unreadable), point.unreadable


def test_garbage_result_and_launch_json_is_one_line(tmp_path):
    run = _run(tmp_path)
    RunPaths(root=run).result.write_text("[]")
    RunPaths(root=run).launch.write_text("[]")
    done = run_dlaunch("report", str(run), "--format", "json", "--no-predict", timeout=60)
    assert_one_line_error(done, "no readable run", "launch.json is not a launch spec")


def test_result_from_dict_names_the_bad_key():
    with pytest.raises(ValueError, match="'world_size': expected an integer"):
        RunResult.from_dict({"run_id": "r", "run_dir": ".", "workload": "w", "world_size": "2",
                             "num_nodes": 1, "device": "cpu", "strategy": "ddp",
                             "precision": "fp32", "status": "ok", "exit_code": 0,
                             "wall_time_s": 1.0, "samples_per_s": 1.0, "units_per_s": 1.0,
                             "sample_units": "samples", "step_time_median_s": 0.1,
                             "slowest_rank": 0, "data_wait_share": 0.0, "ranks": []})


def test_a_claimed_billion_ranks_reads_only_the_files_present(tmp_path):
    run = _run(tmp_path)
    # the most ranks launch.json may claim (--gpus and --nodes at their bounds): 409,600,000
    _launch(run, gpus=4096, nodes=100_000)
    res = aggregate(run)
    assert res.world_size == 4096 * 100_000 and res.status == "failed"
    assert [r.status for r in res.ranks[:2]] == ["ok", "ok"] and len(res.ranks) < 100
    assert any("409,599,9" in f and "wrote no rank file" in f for f in res.failures)
    point = _report(run)
    assert any("wrote no rank file" in n for n in point.unreadable)
    done = run_dlaunch("report", str(run), "--format", "json,md", "--no-predict", timeout=60)
    assert done.code == 0 and "Traceback" not in done.err, done.err


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _owner(run: Path, pid: int) -> None:
    RunPaths(root=run).owner.write_text(json.dumps(
        {"pid": pid, "host": socket.gethostname(), "time": time.time(), "run_id": run.name}))


def _cut_short(run: Path) -> None:
    """The ranks stopped mid-run: no end record, no summary, no result.json."""
    for rank in (0, 1):
        path = RunPaths(root=run).records(rank)
        path.write_text("".join(line + "\n" for line in path.read_text().splitlines()[:-1]))
        RunPaths(root=run).summary(rank).unlink()


def test_a_run_whose_launcher_died_is_orphaned(tmp_path):
    run = _run(tmp_path)
    _cut_short(run)
    _owner(run, _dead_pid())
    assert aggregate(run).status == "orphaned"
    assert _report(run).status == "orphaned"


def test_a_run_whose_launcher_lives_is_running(tmp_path):
    run = _run(tmp_path)
    _cut_short(run)
    _owner(run, os.getpid())
    assert aggregate(run).status == "running"
    assert _report(run).status == "running"


def test_with_a_result_or_at_the_launchers_own_aggregation_the_owner_is_not_asked(tmp_path):
    run = _run(tmp_path)
    _owner(run, _dead_pid())
    assert aggregate(run, exit_code=0).status == "ok"
    RunPaths(root=run).result.write_text(json.dumps(aggregate(run, exit_code=0).to_dict()))
    assert aggregate(run).status == "ok"


def test_records_of_another_run_are_ignored_and_counted(tmp_path):
    run = _run(tmp_path, world_size=1)
    path = RunPaths(root=run).records(0)
    ours = path.read_text().splitlines()
    ours[0] = json.dumps({**json.loads(ours[0]), "run_id": run.name}, separators=(",", ":"))
    theirs = [json.dumps({**json.loads(ours[0]), "run_id": "other-run"}, separators=(",", ":"))]
    theirs += [line.replace('"step_time_s":0.1', '"step_time_s":9.0') for line in ours[2:-1]]
    # the other run's start and 6 steps first, then ours, then a step naming the other run
    stray = json.loads(ours[3]) | {"run_id": "other-run", "step_time_s": 9.0}
    path.write_text("\n".join([*theirs, *ours, json.dumps(stray)]) + "\n")
    res = aggregate(run)
    assert res.ranks[0].steps == 6 and res.attempts == 1
    assert res.step_time_median_s == pytest.approx(0.1)
    assert any("ignored 8 record(s) of another run (other-run)" in n for n in res.unreadable), res.unreadable
    point = _report(run)
    assert point.step_time_s == pytest.approx(0.1)
    assert max(g["max"] for g in point.distribution["groups"]) == pytest.approx(0.1)

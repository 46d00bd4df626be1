"""A run read while it trains: its ranks are running, not failed, and the report says it is live."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from launcher.files import atomic_write_json
from launcher.report.scaling import build_report
from launcher.results.aggregate import aggregate
from launcher.rundir import RunPaths

from tests.synthetic import write_run


def _in_progress(run_dir: Path, *, owner_pid: int) -> None:
    """The files of a run that has not finished: no summaries, no result, an owner file."""
    write_run(run_dir, world_size=2)
    paths = RunPaths(root=run_dir)
    paths.result.unlink(missing_ok=True)
    for rank in (0, 1):
        paths.summary(rank).unlink(missing_ok=True)
    atomic_write_json(paths.owner, {"host": socket.gethostname(), "pid": owner_pid, "time": time.time()})


def test_a_live_run_is_running_with_no_failures(tmp_path: Path):
    _in_progress(tmp_path / "run", owner_pid=os.getpid())  # this process: alive
    result = aggregate(tmp_path / "run")
    assert result.status == "running"
    assert [r.status for r in result.ranks] == ["running", "running"]
    assert result.failures == ()
    report = build_report(tmp_path / "run")
    assert report.live and report.headline().startswith("one run on 2 rank(s), live:")


def test_an_orphaned_run_still_names_its_ranks_as_failed(tmp_path: Path):
    # the owner is gone (a pid that cannot be alive): the ranks without summaries did not finish
    _in_progress(tmp_path / "run", owner_pid=2**22 + 12345)
    result = aggregate(tmp_path / "run")
    assert result.status == "orphaned"
    assert [r.status for r in result.ranks] == ["incomplete", "incomplete"]
    assert len(result.failures) == 2
    report = build_report(tmp_path / "run")
    assert not report.live and report.headline() == "one run on 2 rank(s)"

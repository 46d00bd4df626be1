"""results.trackers: the feed that tails rank 0's records into the trackers, with a recording
tracker in place of TensorBoard / MLflow / W&B (those are read back in
tests/integration/test_trackers.py)."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from typing import Any

import pytest

from launcher.errors import LaunchError
from launcher.results import trackers
from launcher.results.trackers import TrackerFeed, check_trackers, step_metrics
from launcher.results.types import RunResult
from launcher.rundir import RunPaths
from launcher.specs import TRACKERS

from tests.synthetic import write_run


class Recorder:
    made: list[Recorder] = []

    def __init__(self, run_dir: Path, params: dict[str, Any]) -> None:
        self.params, self.logged, self.closed = params, [], None
        Recorder.made.append(self)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.logged.append((step, dict(metrics)))

    def close(self, ok: bool) -> None:
        self.closed = ok


def _broken(run_dir: Path, params: dict[str, Any]) -> Any:
    raise ConnectionError("no server at http://nowhere:5000\nsecond line")


@pytest.fixture
def recorder(monkeypatch) -> type[Recorder]:
    Recorder.made = []
    monkeypatch.setitem(trackers._SINKS, "tensorboard", Recorder)
    monkeypatch.setitem(trackers._SINKS, "mlflow", _broken)
    return Recorder


def test_every_tracker_has_a_package_and_a_sink():
    assert set(trackers._NEEDS) == set(trackers._SINKS) == set(TRACKERS)


def test_a_missing_package_is_one_line_before_the_run(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(LaunchError, match=r"^--log-to mlflow: the mlflow package is not installed .*"
                                          r"pip install mlflow-skinny"):
        check_trackers(("mlflow",))


def test_step_metrics_leave_out_a_nan_loss():
    assert step_metrics({"step": 3, "loss": None, "step_time_s": 0.5, "samples": 8, "data_wait_s": 0.1}) == {
        "train/step_time_s": 0.5, "train/samples_per_s": 16.0, "train/data_wait_s": 0.1}


def test_the_feed_logs_each_step_once_then_the_summary(tmp_path: Path, recorder):
    run = write_run(tmp_path / "run", world_size=2, steps=6)
    said: list[str] = []
    feed = TrackerFeed(("tensorboard", "mlflow"), run, {"run_id": "r"}, warn=said.append)
    feed._open()
    path = RunPaths(root=run).records(0)
    full = path.read_bytes()
    # a line still being written (no newline yet) waits; the next drain takes it whole
    path.write_bytes(full[:full.rindex(b'"step"')])
    feed._drain()
    [sink] = Recorder.made
    early = [s for s, _ in sink.logged]
    path.write_bytes(full)
    feed._drain()
    result = RunResult.from_dict(json.loads(RunPaths(root=run).result.read_text()))
    feed.finish(result)
    steps = [s for s, m in sink.logged if "train/step_time_s" in m]
    assert steps == list(range(1, 7)) and early == list(range(1, 6))
    last_step, summary = sink.logged[-1]
    assert last_step == 6 and summary["summary/samples_per_s"] == result.samples_per_s
    assert sink.closed is (result.status == "ok") is True
    # the tracker that could not start: one line (its error's first line), and nothing more
    assert said == ["--log-to mlflow: could not start (ConnectionError: no server at http://nowhere:5000); "
                    "not logging to it (the run dir keeps every metric)"]
    assert feed.dropped == {"mlflow": "could not start (ConnectionError: no server at http://nowhere:5000)"}


def test_a_restart_s_new_rank_file_is_read_from_its_start(tmp_path: Path, recorder):
    run = write_run(tmp_path / "run", world_size=1, steps=4)
    feed = TrackerFeed(("tensorboard",), run, {"run_id": "r"}, warn=lambda _: None)
    feed._open()
    feed._drain()
    path = RunPaths(root=run).records(0)
    records = [json.loads(x) for x in path.read_text().splitlines()]
    path.rename(tmp_path / "attempt-0.jsonl")  # the relaunch writes a fresh file
    path.write_text("".join(json.dumps(r) + "\n" for r in records if r["kind"] != "step" or r["step"] > 2))
    feed.finish(None)
    [sink] = Recorder.made
    assert [s for s, m in sink.logged if "train/step_time_s" in m] == [1, 2, 3, 4, 3, 4]
    assert sink.closed is False  # no result: the run did not end well


def test_the_thread_feeds_while_the_run_goes(tmp_path: Path, recorder):
    run = write_run(tmp_path / "run", world_size=1, steps=3)
    feed = TrackerFeed(("tensorboard",), run, {"run_id": "r"}, interval_s=0.02, warn=lambda _: None)
    feed.start()
    import time

    deadline = time.monotonic() + 10
    while not (Recorder.made and len(Recorder.made[0].logged) >= 3) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [s for s, _ in Recorder.made[0].logged] == [1, 2, 3]  # before finish
    feed.finish(None)


class Hanging(Recorder):
    def close(self, ok: bool) -> None:
        time.sleep(600)  # a server that stopped answering


def test_a_tracker_that_hangs_at_the_end_costs_the_wait_and_one_line(tmp_path: Path, monkeypatch):
    monkeypatch.setitem(trackers._SINKS, "tensorboard", Hanging)
    Recorder.made = []
    run = write_run(tmp_path / "run", world_size=1, steps=3)
    said: list[str] = []
    feed = TrackerFeed(("tensorboard",), run, {"run_id": "r"}, interval_s=0.02, warn=said.append)
    feed.start()
    started = time.monotonic()
    dropped = feed.finish(None, wait_s=0.3)
    assert time.monotonic() - started < 2.0  # the wait, not the tracker, bounds the end
    assert [s for s, _ in Recorder.made[0].logged] == [1, 2, 3]  # logged before it hung
    assert dropped == {"tensorboard": "no answer within 0.3 s of the run's end, its last metrics not logged"}
    assert said == [f"--log-to tensorboard: {dropped['tensorboard']}; not logging to it (the run dir keeps "
                    "every metric)"]

"""The communication calibration's arithmetic, and the step times it takes from the logging
windows (runtime.calibrate, runtime.window), without torchrun."""

from __future__ import annotations

import torch

from launcher.runtime.calibrate import CHEAP_S, MAX_PASSES, passes_within
from launcher.runtime.context import from_env
from launcher.runtime.recorder import RankRecorder
from launcher.runtime.window import Clock, Window


def test_sync_off_passes_fit_in_one_step():
    assert passes_within(1.0, 0.9) == 1  # a pass almost as long as the step: the one pass
    assert passes_within(1.0, 2.0) == 1  # never none, even when one pass is longer
    assert passes_within(1.0, 0.4) == 2
    assert passes_within(10.0, 0.1) == MAX_PASSES


def test_short_steps_take_every_pass_within_the_cheap_budget():
    assert passes_within(0.001, CHEAP_S / MAX_PASSES) == MAX_PASSES
    assert passes_within(0.001, CHEAP_S) == 1


def _window(tmp_path) -> Window:
    ctx = from_env("cpu", env={})
    recorder = RankRecorder(tmp_path, 0, {"world_size": 1})
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    return Window(Clock("cpu"), ctx, recorder, scaler, torch.device("cpu"), log_every=10)


def test_window_keeps_the_steady_steps_forward_backward_times(tmp_path):
    window = _window(tmp_path)
    window.length = 4
    steps = [(1, True, False, 0.5), (2, False, False, 0.2), (3, False, True, 0.9),
             (4, False, False, 0.3)]
    for step, warmup, profiled, fb_s in steps:
        record = {"kind": "step", "step": step, "warmup": warmup, "profiled": profiled,
                  "end_time": float(step), "data_wait_s": 0.0, "samples": 1, "units": 1}
        window.add(record, fb_s + 0.1, torch.tensor(1.0), fb_s)
    assert window.fwd_bwd_times() == []  # nothing until the window closes
    window.close()
    # warm-up and profiled steps left out; the step times themselves are untouched
    assert window.fwd_bwd_times() == [0.2, 0.3]
    steps_written = [line for line in (tmp_path / "rank-0.jsonl").read_text().splitlines()
                     if '"kind":"step"' in line]
    assert '"step_time_s":0.6' in steps_written[0]


def test_window_falls_back_to_every_step_when_none_was_steady(tmp_path):
    window = _window(tmp_path)
    record = {"kind": "step", "step": 1, "warmup": True, "end_time": 1.0, "data_wait_s": 0.0,
              "samples": 1, "units": 1}
    window.add(record, 0.5, torch.tensor(1.0), 0.4)
    window.close()
    assert window.fwd_bwd_times() == [0.4]

"""workloads/gpt.py with its tp_plan and a loss that turns NaN from the `nan_step`-th loss_fn call on
(run with --no-calibrate: training step `nan_step`), for --detect-anomaly under tensor parallelism
(tests/integration/test_diagnostics.py): the multiply by NaN is the forward op anomaly mode names."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "dlaunch_test_gpt_nan_base", Path(__file__).resolve().parents[2] / "workloads" / "gpt.py")
_gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_gpt)

DEFAULTS = {**_gpt.DEFAULTS, "nan_step": 2}
SAMPLE_UNITS = _gpt.SAMPLE_UNITS
_calls = {"n": 0}
_cfg = {}


def build_model(cfg):
    _cfg.update(vars(cfg))
    return _gpt.build_model(cfg)


def blocks(model):
    return _gpt.blocks(model)


def units_per_sample(cfg):
    return _gpt.units_per_sample(cfg)


def make_dataset(cfg, num_samples):
    return _gpt.make_dataset(cfg, num_samples)


def tp_plan(model, tp):
    return _gpt.tp_plan(model, tp)


def loss_fn(model, batch):
    _calls["n"] += 1
    loss = _gpt.loss_fn(model, batch)
    return loss * float("nan") if _calls["n"] >= _cfg["nan_step"] else loss

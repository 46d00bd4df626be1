"""tests/data/fault.py's model and data with a loss that is NaN from the `nan_step`-th loss_fn
call on (run with --no-calibrate so that call is the training step of that number), on every
rank."""

import importlib.util
from pathlib import Path

import torch.nn.functional as F

_spec = importlib.util.spec_from_file_location(
    "dlaunch_test_fault_base", Path(__file__).resolve().parent / "fault.py")
_fault = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fault)

DEFAULTS = {"nan_step": 3}
_calls = {"n": 0}
_cfg = {}


def build_model(cfg):
    _cfg.update(vars(cfg))
    return _fault.build_model(cfg)


make_dataset = _fault.make_dataset


def loss_fn(model, batch):
    _calls["n"] += 1
    x, y = batch
    loss = F.cross_entropy(model(x), y)
    # still a function of the parameters: backward runs and the optimizer step spreads the NaN
    return loss * float("nan") if _calls["n"] >= _cfg["nan_step"] else loss

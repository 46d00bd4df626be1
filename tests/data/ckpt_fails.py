"""workloads/mlp.py, except that a block run under activation checkpointing raises: a tune
candidate with checkpointing crashes while the others train (on the meta device, where the
planner profiles it, nothing raises)."""

import importlib.util
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "dlaunch_test_mlp", Path(__file__).resolve().parents[2] / "workloads" / "mlp.py")
_mlp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mlp)

DEFAULTS = dict(_mlp.DEFAULTS)
SAMPLE_UNITS = _mlp.SAMPLE_UNITS


def blocks(model):
    return _mlp.blocks(model)


def make_dataset(cfg, num_samples):
    return _mlp.make_dataset(cfg, num_samples)


def loss_fn(model, batch):
    return _mlp.loss_fn(model, batch)


def _under_checkpoint():
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.replace("\\", "/").endswith("torch/utils/checkpoint.py"):
            return True
        frame = frame.f_back
    return False


class _Fails(_mlp.MLP):
    def __init__(self, *a):
        super().__init__(*a)
        for layer in self.layers:
            layer.register_forward_pre_hook(self._check)

    @staticmethod
    def _check(module, inputs):
        if inputs[0].device.type != "meta" and _under_checkpoint():
            raise RuntimeError("injected failure: this workload cannot run under activation checkpointing")


def build_model(cfg):
    return _Fails(cfg.features, cfg.hidden, cfg.depth, cfg.classes)

"""workloads/mlp.py, except that a block run under activation checkpointing raises: a tune
candidate with checkpointing crashes while the others train (on the meta device, where the
planner profiles it, nothing raises). With `-- --fp32-only` a block run in a low precision
(autocast, or bf16/fp16 tensors) raises too: of the two candidates a CPU's plan puts nearest the
best (DDP fp32 with and without checkpointing, or DDP bf16 and fp32 where the CPU has bf16
units) one trains and one crashes, whichever CPU it is."""

import importlib.util
import sys
from pathlib import Path

import torch

_spec = importlib.util.spec_from_file_location(
    "dlaunch_test_mlp", Path(__file__).resolve().parents[2] / "workloads" / "mlp.py")
_mlp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mlp)

DEFAULTS = {**_mlp.DEFAULTS, "fp32_only": False}
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


def _low_precision(x):
    return torch.is_autocast_enabled(x.device.type) or x.dtype in (torch.bfloat16, torch.float16)


class _Fails(_mlp.MLP):
    def __init__(self, *a, fp32_only=False):
        super().__init__(*a)
        self.fp32_only = fp32_only
        for layer in self.layers:
            layer.register_forward_pre_hook(self._check)

    def _check(self, module, inputs):
        if inputs[0].device.type == "meta":
            return
        if _under_checkpoint():
            raise RuntimeError("injected failure: this workload cannot run under activation checkpointing")
        if self.fp32_only and _low_precision(inputs[0]):
            raise RuntimeError("injected failure: this workload trains in fp32 only (--fp32-only)")


def build_model(cfg):
    return _Fails(cfg.features, cfg.hidden, cfg.depth, cfg.classes, fp32_only=cfg.fp32_only)

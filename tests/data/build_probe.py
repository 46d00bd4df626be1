"""workloads/mlp.py with a non-persistent buffer its loss depends on, noting every build_model call:
each rank appends "<device a new tensor gets> <torch's default device>" to BUILD_PROBE_DIR/rank<R>.txt.
BUILD_PROBE_META_FAILS=1: a build on the meta device raises after noting it; =attribute: the model keeps a
tensor as a plain attribute (neither parameter nor buffer), which its forward reads."""

import importlib.util
import os
from pathlib import Path

import torch

_spec = importlib.util.spec_from_file_location(
    "dlaunch_test_mlp_base", Path(__file__).resolve().parents[2] / "workloads" / "mlp.py")
_mlp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mlp)

DEFAULTS = _mlp.DEFAULTS
SAMPLE_UNITS = _mlp.SAMPLE_UNITS


class Scaled(_mlp.MLP):
    def __init__(self, *args):
        super().__init__(*args)
        # not in the state dict: a rank that never got rank 0's value trains on garbage
        self.register_buffer("scale", torch.linspace(0.5, 1.5, args[0]), persistent=False)

    def forward(self, x):
        return super().forward(x * self.scale + getattr(self, "shift", 0.0))


def build_model(cfg):
    rank = os.environ.get("RANK", "none")  # none: the planner's profile in dlaunch itself
    with open(Path(os.environ["BUILD_PROBE_DIR"]) / f"rank{rank}.txt", "a") as f:
        f.write(f"{torch.empty(0).device.type} {torch.get_default_device().type}\n")
    fails = os.environ.get("BUILD_PROBE_META_FAILS")
    if fails == "1" and torch.empty(0).is_meta:
        raise RuntimeError("this build reads a value")
    model = Scaled(cfg.features, cfg.hidden, cfg.depth, cfg.classes)
    if fails == "attribute":
        model.shift = torch.zeros(cfg.features)
    return model


blocks = _mlp.blocks
make_dataset = _mlp.make_dataset
loss_fn = _mlp.loss_fn

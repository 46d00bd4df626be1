"""A tiny workload that fails unless the rank builds its model with the cyclic GC off and trains
with it on, what setup made frozen (runtime.entry / runtime.harness)."""

import gc
import os

import torch.nn.functional as F
from fault import make_dataset  # noqa: F401 - the same 8-feature data as fault.py (a sibling file)
from torch import nn


def _in_rank():
    return "DLAUNCH_RUN_DIR" in os.environ  # not when dlaunch profiles it for the plan


def build_model(cfg):
    if _in_rank() and gc.isenabled():
        raise RuntimeError("the cyclic GC ran during setup")
    return nn.Linear(8, 2)


def loss_fn(model, batch):
    if _in_rank() and (not gc.isenabled() or gc.get_freeze_count() < 10_000):
        raise RuntimeError(f"training without the GC or without a frozen setup: enabled "
                           f"{gc.isenabled()}, {gc.get_freeze_count()} objects frozen")
    x, y = batch
    return F.cross_entropy(model(x), y)

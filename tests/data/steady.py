"""A tiny workload that trains at a steady, slow pace, optionally printing a lot: a job that is
still running when a test kills, interrupts or stops reading dlaunch.

  --step-sleep-s S   every micro-batch sleeps S seconds (default 0.2)
  --chatter N        every micro-batch prints N long lines to stdout (default 0)
"""

import sys
import time

import torch.nn.functional as F
from fault import make_dataset  # noqa: F401 - the same 8-feature data as fault.py (a sibling file)
from torch import nn

DEFAULTS = {"step_sleep_s": 0.2, "chatter": 0}
_cfg = {}
_LINE = "chatter " + "x" * 200 + "\n"


def build_model(cfg):
    _cfg.update(vars(cfg))
    return nn.Linear(8, 2)


def loss_fn(model, batch):
    time.sleep(float(_cfg["step_sleep_s"]))
    if _cfg["chatter"]:
        sys.stdout.write(_LINE * int(_cfg["chatter"]))
    x, y = batch
    return F.cross_entropy(model(x), y)

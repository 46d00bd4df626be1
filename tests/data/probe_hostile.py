"""A workload whose real steps misbehave (its meta-device profile is fine): what the planner's
step probe must survive in a child process.

  --hostile sleep    every real step sleeps an hour
  --hostile exit     the first real step calls sys.exit(0)
  --hostile flood    the first real step writes 2 MiB of binary to stderr, then raises
"""

import os
import sys
import time

import torch.nn.functional as F
from fault import make_dataset  # noqa: F401 - the same 8-feature data as fault.py (a sibling file)
from torch import nn

DEFAULTS = {"hostile": "sleep"}
_cfg = {}


def build_model(cfg):
    _cfg.update(vars(cfg))
    return nn.Linear(8, 2)


def loss_fn(model, batch):
    x, y = batch
    if x.device.type != "meta":  # the profile runs on meta; the step probe on real tensors
        if _cfg["hostile"] == "sleep":
            time.sleep(3600)
        elif _cfg["hostile"] == "exit":
            sys.exit(0)
        elif _cfg["hostile"] == "flood":
            sys.stderr.buffer.write(os.urandom(2 * 1024 * 1024))
            sys.stderr.flush()
            raise RuntimeError("the workload flooded its stderr and gave up")
    return F.cross_entropy(model(x), y)

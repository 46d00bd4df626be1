"""A tiny workload that trains at a steady, slow pace, optionally printing a lot: a job that is
still running when a test kills, interrupts or stops reading dlaunch.

  --step-sleep-s S   every micro-batch sleeps S seconds (default 0.2)
  --chatter N        every micro-batch prints N long lines to stdout (default 0); with N > 0 its
                     model's build also logs a warning through a library's logger
  --slow-rank R      rank R (-1: none) sleeps --slow-sleep-s instead, from its call number
  --slow-from N      N of loss_fn on (a straggler appearing mid-run)
"""

import logging
import os
import sys
import time

import torch.nn.functional as F
from fault import make_dataset  # noqa: F401 - the same 8-feature data as fault.py (a sibling file)
from torch import nn

DEFAULTS = {"step_sleep_s": 0.2, "chatter": 0, "slow_rank": -1, "slow_from": 0, "slow_sleep_s": 0.0}
_cfg = {}
_calls = [0]
_LINE = "chatter " + "x" * 200 + "\n"


def build_model(cfg):
    _cfg.update(vars(cfg))
    if _cfg["chatter"]:
        logging.getLogger("chatty.lib").warning("chatter from a library's logger")
    return nn.Linear(8, 2)


def loss_fn(model, batch):
    _calls[0] += 1
    slow = (int(_cfg["slow_rank"]) == int(os.environ.get("RANK", "0"))
            and _calls[0] >= int(_cfg["slow_from"]))
    time.sleep(float(_cfg["slow_sleep_s"] if slow else _cfg["step_sleep_s"]))
    if _cfg["chatter"]:
        sys.stdout.write(_LINE * int(_cfg["chatter"]))
    x, y = batch
    return F.cross_entropy(model(x), y)

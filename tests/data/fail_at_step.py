"""A workload whose rank `fail_rank` raises in its `fail_step`-th call of loss_fn (the fault path;
run it with --no-calibrate so that call is the training step of that number)."""

import os

import torch
import torch.nn.functional as F
from torch import nn

DEFAULTS = {"fail_rank": 1, "fail_step": 3}
_calls = {"n": 0}
_cfg = {}


def build_model(cfg):
    _cfg.update(vars(cfg))
    return nn.Linear(8, 2)


class Data(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(8, generator=g), int(i % 2)


def make_dataset(cfg, num_samples):
    return Data(num_samples)


def loss_fn(model, batch):
    _calls["n"] += 1
    if int(os.environ.get("RANK", 0)) == _cfg["fail_rank"] and _calls["n"] == _cfg["fail_step"]:
        raise ValueError(f"injected failure at step {_calls['n']}")
    x, y = batch
    return F.cross_entropy(model(x), y)

"""A tiny MLP workload whose rank 1 sleeps SLOW_RANK_SLEEP_MS (default 50) ms in every
micro-batch, to check that dlaunch names it as the straggler."""

import os
import time

import torch
import torch.nn.functional as F
from torch import nn

DEFAULTS = {"features": 32, "classes": 4}
SAMPLE_UNITS = "samples"
SLOW_RANK = 1


def build_model(cfg):
    return nn.Sequential(nn.Linear(cfg.features, 32), nn.GELU(), nn.Linear(32, cfg.classes))


class Data(torch.utils.data.Dataset):
    def __init__(self, n, features, classes):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, features, generator=g)
        self.y = torch.randint(0, classes, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def make_dataset(cfg, num_samples):
    return Data(num_samples, cfg.features, cfg.classes)


def loss_fn(model, batch):
    if int(os.environ.get("RANK", "0")) == SLOW_RANK:
        time.sleep(float(os.environ.get("SLOW_RANK_SLEEP_MS", "50")) / 1000)
    x, y = batch
    return F.cross_entropy(model(x), y)

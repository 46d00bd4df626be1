"""A workload whose loss overflows fp16 on every `overflow_every`-th call (GradScaler must skip)."""

import torch
import torch.nn.functional as F
from torch import nn

DEFAULTS = {"overflow_every": 2}
_calls = {"n": 0}
_cfg = {}


def build_model(cfg):
    _cfg.update(vars(cfg))
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


class Data(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.randn(16, generator=torch.Generator().manual_seed(i)), i % 4


def make_dataset(cfg, num_samples):
    return Data(num_samples)


def loss_fn(model, batch):
    _calls["n"] += 1
    x, y = batch
    loss = F.cross_entropy(model(x), y)
    if _calls["n"] % _cfg["overflow_every"] == 0:
        loss = loss * float("inf")  # gradients become inf/NaN: the scaler must skip this step
    return loss

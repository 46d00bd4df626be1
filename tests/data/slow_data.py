"""A workload whose dataset sleeps per item (a slow decoder / remote read) and whose loss sleeps
per sample (stand-in compute with a fixed cost), so the data-loading share of the step does not
depend on how fast this machine is: with `num_workers=0` the loop waits sleep_ms per sample for
every batch; with enough workers the batches are ready before the compute of the step ends."""

import time

import torch
import torch.nn.functional as F
from torch import nn

DEFAULTS = {"sleep_ms": 10.0, "compute_ms": 10.0}
_cfg = {}


def build_model(cfg):
    _cfg.update(vars(cfg))
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


class SlowData(torch.utils.data.Dataset):
    def __init__(self, n, sleep_s):
        self.n, self.sleep_s = n, sleep_s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.sleep_s)
        return torch.randn(16, generator=torch.Generator().manual_seed(i)), i % 4


def make_dataset(cfg, num_samples):
    return SlowData(num_samples, cfg.sleep_ms / 1000.0)


def loss_fn(model, batch):
    x, y = batch
    time.sleep(_cfg["compute_ms"] / 1000.0 * len(x))
    return F.cross_entropy(model(x), y)

"""A workload with an ordinary bug, not a meta-device problem: loss_fn calls .view() on the
transposed (non-contiguous) targets, which fails on CPU exactly as it does on meta."""

import torch
import torch.nn.functional as F
from torch import nn


def build_model(cfg):
    return nn.Linear(4, 3)


def make_dataset(cfg, num_samples):
    return [(torch.randn(2, 4), torch.tensor([0, 1])) for _ in range(num_samples)]


def loss_fn(model, batch):
    x, y = batch  # x: (batch, 2, 4), y: (batch, 2)
    logits = model(x).view(-1, 3)
    return F.cross_entropy(logits, y.t().view(-1))  # bug: y.t() is not contiguous

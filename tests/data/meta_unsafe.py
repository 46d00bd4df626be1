"""A workload that cannot run on the meta device: loss_fn reads a value with .item()."""

import torch
import torch.nn.functional as F
from torch import nn


def build_model(cfg):
    return nn.Linear(4, 2)


def make_dataset(cfg, num_samples):
    return [(torch.randn(4), 0) for _ in range(num_samples)]


def loss_fn(model, batch):
    x, y = batch
    out = model(x)
    if out.abs().max().item() > 1e6:  # data-dependent: impossible on meta
        raise RuntimeError("diverged")
    return F.cross_entropy(out, y)

"""A workload whose model differs between ranks (rank 1 has a wider hidden layer): FSDP's
collectives then disagree on tensor shapes between ranks."""

import os

import torch
import torch.nn.functional as F
from torch import nn

DEFAULTS = {}


def build_model(cfg):
    hidden = 16 + 8 * int(os.environ.get("RANK", "0"))
    return nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 2))


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 1024

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(8, generator=g), int(i % 2)


def make_dataset(cfg, num_samples):
    return Data()


def loss_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)

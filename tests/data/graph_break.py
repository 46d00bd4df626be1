"""A small MLP whose blocks print a debugging line in forward: a graph break for torch.compile
(Dynamo cannot trace print), harmless when run eagerly."""

import torch
import torch.nn.functional as F
from torch import nn

SAMPLE_UNITS = "samples"


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        x = F.gelu(self.linear(x))
        print("block output", tuple(x.shape))  # the deliberate graph break
        return x


class Net(nn.Module):
    def __init__(self, width=32, depth=4):
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.out = nn.Linear(width, 4)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def build_model(cfg):
    return Net()


def blocks(model):
    return list(model.layers)


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
    x, y = batch
    return F.cross_entropy(model(x), y)

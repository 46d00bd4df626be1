"""A small multi-layer perceptron on a synthetic classification task (a fixed random teacher
labels Gaussian inputs), the cheapest workload: communication dominates it on CPU."""

import torch
import torch.nn.functional as F
from torch import nn

DEFAULTS = {"features": 256, "hidden": 512, "depth": 4, "classes": 10}
SAMPLE_UNITS = "samples"


class MLP(nn.Module):
    def __init__(self, features, hidden, depth, classes):
        super().__init__()
        dims = [features] + [hidden] * depth
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(i, o), nn.GELU()) for i, o in zip(dims[:-1], dims[1:])
        )
        self.out = nn.Linear(hidden, classes)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def build_model(cfg):
    return MLP(cfg.features, cfg.hidden, cfg.depth, cfg.classes)


def blocks(model):
    return list(model.layers)


class Teacher(torch.utils.data.Dataset):
    def __init__(self, num_samples, features, classes):
        self.n, self.features = num_samples, features
        self.w = torch.randn(features, classes, generator=torch.Generator().manual_seed(7))

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x = torch.randn(self.features, generator=torch.Generator().manual_seed(10_007 + i))
        return x, torch.argmax(x @ self.w)


def make_dataset(cfg, num_samples):
    return Teacher(num_samples, cfg.features, cfg.classes)


def loss_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)

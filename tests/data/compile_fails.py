"""A workload that trains eagerly but cannot be compiled: its model calls a custom op whose
fake (meta) kernel raises, so Dynamo fails while tracing the first forward, deterministically
and without invoking a C++ compiler."""

import torch
import torch.nn.functional as F
from torch import nn


@torch.library.custom_op("dlaunch_test::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@twice.register_fake
def _(x):
    raise RuntimeError("dlaunch_test::twice has no fake kernel (on purpose)")


twice.register_autograd(lambda ctx, grad: grad * 2)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.b(twice(torch.relu(self.a(x))))


def build_model(cfg):
    return Net()


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

"""A small ResNet (basic blocks, batch norm) on synthetic 32x32 images, written here because
there is no CPU build of torchvision. Labels come from a fixed colour/position rule, so the
loss falls."""

import torch
import torch.nn.functional as F
from torch import nn

DEFAULTS = {"width": 32, "blocks_per_stage": 2, "classes": 10, "image_size": 32}
SAMPLE_UNITS = "images"


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = nn.Sequential()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.short(x))


class ResNet(nn.Module):
    def __init__(self, width, per_stage, classes):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        layers, cin = [], width
        for i, cout in enumerate((width, width * 2, width * 4)):
            for j in range(per_stage):
                layers.append(BasicBlock(cin, cout, 2 if (i > 0 and j == 0) else 1))
                cin = cout
        self.layers = nn.ModuleList(layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def build_model(cfg):
    return ResNet(cfg.width, cfg.blocks_per_stage, cfg.classes)


def blocks(model):
    return list(model.layers)


class Images(torch.utils.data.Dataset):
    def __init__(self, num_samples, size, classes):
        self.n, self.size, self.classes = num_samples, size, classes

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(20_011 + i)
        label = int(torch.randint(0, self.classes, (1,), generator=g))
        img = 0.5 * torch.randn(3, self.size, self.size, generator=g)
        # the class is visible: a bright square whose position and colour depend on the label
        c, r = label % 3, (label * 3) % (self.size - 8)
        img[c, r:r + 8, r:r + 8] += 2.0
        return img, label


def make_dataset(cfg, num_samples):
    return Images(num_samples, cfg.image_size, cfg.classes)


def loss_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)

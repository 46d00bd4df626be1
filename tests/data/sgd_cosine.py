"""A workload with its own optimizer and schedule: SGD with momentum 0.9 and weight-decay groups
by parameter name, a linear warm-up then cosine decay (LambdaLR), and an `evaluate` that reports
the learning rate, whether every trained parameter has a momentum buffer, and a held-out loss.

Data, loss and the fault injection (`--fault sigkill --fault-step N`, see fault.py) come from
its neighbour tests/data/fault.py, imported as a sibling module the way `python file.py` allows.
"""

import math

import torch
import torch.nn.functional as F
from fault import DEFAULTS as FAULT_DEFAULTS
from fault import build_model as _fault_build
from fault import loss_fn, make_dataset  # noqa: F401 - part of this workload's contract
from torch import nn

DEFAULTS = {**FAULT_DEFAULTS, "fault_rank": -1, "lr": 0.2, "warmup": 3, "total_steps": 12}
_state = {}


def build_model(cfg):
    _fault_build(cfg)  # the fault injection reads its options from there
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def blocks(model):
    return [model[0], model[2]]


def make_optimizer(cfg, model):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    optimizer = torch.optim.SGD([{"params": decay, "weight_decay": 1e-4},
                                 {"params": no_decay, "weight_decay": 0.0}],
                                lr=cfg.lr, momentum=0.9)
    _state["optimizer"] = optimizer
    return optimizer


def lr_factor(step, warmup, total):
    """The schedule after `step` optimizer steps: linear warm-up, then cosine to 10%."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def make_scheduler(cfg, optimizer):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, cfg.warmup, cfg.total_steps))


def evaluate(model, cfg):
    optimizer = _state["optimizer"]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    with_momentum = sum(1 for p in params if "momentum_buffer" in optimizer.state.get(p, {}))
    g = torch.Generator().manual_seed(123)
    x = torch.randn(16, 8, generator=g)
    y = (x.sum(dim=1) > 0).long()
    return {"lr": optimizer.param_groups[0]["lr"], "momentum_share": with_momentum / len(params),
            "val_loss": F.cross_entropy(model(x), y).item()}

"""workloads/mlp.py, except that with `-- --fail-first DIR` each rank's first training forward
raises, once per DIR: the first tune trial crashes and every later one trains, whichever
candidates the plan puts near the best on this machine. A rank marks DIR/rank-<RANK> when it
fails, so a later run (a later trial, or `run --plan` of the tuned plan) trains. Nothing raises
outside a torchrun rank (no RANK: the planner's profile and step probe) or on the meta device."""

import importlib.util
import os
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "dlaunch_test_mlp", Path(__file__).resolve().parents[2] / "workloads" / "mlp.py")
_mlp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mlp)

DEFAULTS = {**_mlp.DEFAULTS, "fail_first": ""}
SAMPLE_UNITS = _mlp.SAMPLE_UNITS


def blocks(model):
    return _mlp.blocks(model)


def make_dataset(cfg, num_samples):
    return _mlp.make_dataset(cfg, num_samples)


def loss_fn(model, batch):
    return _mlp.loss_fn(model, batch)


class _FailsFirst(_mlp.MLP):
    def __init__(self, *a, fail_first=""):
        super().__init__(*a)
        self.fail_first = fail_first
        self.layers[0].register_forward_pre_hook(self._check)

    def _check(self, module, inputs):
        rank = os.environ.get("RANK")
        if not self.fail_first or rank is None or inputs[0].device.type == "meta":
            return
        os.makedirs(self.fail_first, exist_ok=True)
        try:  # O_EXCL: exactly one run per rank and DIR sees the marker missing
            os.close(os.open(os.path.join(self.fail_first, f"rank-{rank}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        raise RuntimeError(f"injected failure: the first run in {self.fail_first} fails (--fail-first)")


def build_model(cfg):
    return _FailsFirst(cfg.features, cfg.hidden, cfg.depth, cfg.classes, fail_first=cfg.fail_first)

"""workloads/gpt.py (same model, data and loss) with one injected fault, for the resume tests.

Rank `fault_rank` raises ValueError in its `fault_step`-th call of loss_fn (with --no-calibrate
and no accumulation: training step `fault_step`) in attempt `fault_attempt` of a
`--max-restarts` run (DLAUNCH_ATTEMPT), as tests/data/fault.py does. `--fault nan`: every rank's
loss is NaN from its `fault_step`-th call on (a multiply, still a function of the parameters: the
op --detect-anomaly names). `--fault none` (default) trains like workloads/gpt.py. `--step-sleep-ms X` pauses every loss_fn call, so a test can
signal or requeue a run while it is in the middle. `--stream` gives the same samples, in
order, as an IterableDataset (launcher/runtime/stream.py splits and resumes it).
"""

import importlib.util
import os
import time
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "dlaunch_test_gpt_base", Path(__file__).resolve().parents[2] / "workloads" / "gpt.py")
_gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_gpt)

DEFAULTS = {**_gpt.DEFAULTS, "fault": "none", "fault_rank": 1, "fault_step": 10,
            "fault_attempt": 0, "step_sleep_ms": 0.0, "stream": False}
SAMPLE_UNITS = _gpt.SAMPLE_UNITS
_calls = {"n": 0}
_cfg = {}


def build_model(cfg):
    _cfg.update(vars(cfg))
    return _gpt.build_model(cfg)


def blocks(model):
    return _gpt.blocks(model)


def units_per_sample(cfg):
    return _gpt.units_per_sample(cfg)


class Stream(_gpt.torch.utils.data.IterableDataset):
    """The map-style dataset's items 0, 1, 2, ... as a stream."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __iter__(self):
        return (self.dataset[i] for i in range(len(self.dataset)))


def make_dataset(cfg, num_samples):
    dataset = _gpt.make_dataset(cfg, num_samples)
    return Stream(dataset) if cfg.stream else dataset


def loss_fn(model, batch):
    _calls["n"] += 1
    attempt = int(os.environ.get("DLAUNCH_ATTEMPT", "0"))
    if (_cfg["fault"] == "raise" and int(os.environ.get("RANK", 0)) == _cfg["fault_rank"]
            and _calls["n"] == _cfg["fault_step"] and _cfg["fault_attempt"] in (-1, attempt)):
        raise ValueError(f"injected failure at step {_calls['n']}")
    if _cfg["step_sleep_ms"] > 0:
        time.sleep(_cfg["step_sleep_ms"] / 1000.0)
    loss = _gpt.loss_fn(model, batch)
    return loss * float("nan") if _cfg["fault"] == "nan" and _calls["n"] >= _cfg["fault_step"] else loss

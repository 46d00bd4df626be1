"""tests/data/fault.py with its checkpoints damaged before a relaunch resumes from them.

With `--corrupt shards`, rank 0 of every relaunch (DLAUNCH_ATTEMPT >= 1) cuts the DCP shard
files of the newest checkpoint in DLAUNCH_CHECKPOINT_DIR to half their size before the model is
built, as a disk that filled up or a copy cut short would; `--corrupt overwrite` overwrites 64
bytes in the middle of each of those shards instead (the size unchanged, as bit rot or a stray
writer would leave them); `--corrupt rng` cuts rank 1's RNG
file in every checkpoint, so none is usable. The ranks resume only after building and wrapping
the model (a collective), so the damage is done before any rank looks at the checkpoints.
"""

import importlib.util
import os
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "dlaunch_test_fault_base", Path(__file__).resolve().parent / "fault.py")
_fault = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fault)

DEFAULTS = {**_fault.DEFAULTS, "corrupt": "none"}


def _halve(path):
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def _overwrite(path):
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        f.write(bytes(range(64)))


def _corrupt(kind):
    steps = sorted(Path(os.environ["DLAUNCH_CHECKPOINT_DIR"]).glob("step-*[0-9]"))
    if kind == "shards":
        for shard in steps[-1].glob("*.distcp"):
            _halve(shard)
    elif kind == "overwrite":
        for shard in steps[-1].glob("*.distcp"):
            _overwrite(shard)
    elif kind == "rng":
        for step in steps:
            _halve(step / "rng-1.pt")


def build_model(cfg):
    if (cfg.corrupt != "none" and int(os.environ.get("DLAUNCH_ATTEMPT", "0")) >= 1
            and int(os.environ.get("RANK", "0")) == 0):
        _corrupt(cfg.corrupt)
    return _fault.build_model(cfg)


make_dataset = _fault.make_dataset
loss_fn = _fault.loss_fn

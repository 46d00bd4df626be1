"""A tiny workload that injects one fault on rank `fault_rank` at its `fault_step`-th call of
loss_fn (run with --no-calibrate so that call is the training step of that number):

  --fault raise     raise ValueError
  --fault sigkill   the rank SIGKILLs itself (no summary, file possibly cut mid-line)
  --fault hang      the rank sleeps forever (the other ranks wait in the gradient all-reduce)
  --fault exit0     the rank exits with code 0 at once (os._exit: no summary, no teardown)
  --fault stubborn  the rank starts a child that ignores SIGTERM (its pid in TMPDIR/stubborn.pid,
                    holding the rank's output open), then raises ValueError
  --fault stuck-data  the rank's dataset never returns an item (its DataLoader waits forever from
                    the first batch; the other ranks wait in a collective for it)

`--fault-attempt N` injects only in attempt N of a `--max-restarts` run (-1: every attempt).
DLAUNCH_TEST_FAULT and DLAUNCH_TEST_FAULT_ATTEMPT set the defaults of --fault and --fault-attempt:
runs that differ only in them have the same workload arguments, so share one cached profile and
step timing.
"""

import os
import signal
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

DEFAULTS = {"fault": os.environ.get("DLAUNCH_TEST_FAULT", "raise"), "fault_rank": 1, "fault_step": 3,
            "fault_attempt": int(os.environ.get("DLAUNCH_TEST_FAULT_ATTEMPT", "-1"))}
_calls = {"n": 0}
_cfg = {}


def build_model(cfg):
    _cfg.update(vars(cfg))
    return nn.Linear(8, 2)


class Data(torch.utils.data.Dataset):
    def __init__(self, n, stuck=False):
        self.n, self.stuck = n, stuck

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        while self.stuck:
            time.sleep(3600)
        g = torch.Generator().manual_seed(i)
        return torch.randn(8, generator=g), int(i % 2)


def make_dataset(cfg, num_samples):
    # getattr: sibling workloads reuse this data without the fault options
    stuck = getattr(cfg, "fault", None) == "stuck-data" and int(os.environ.get("RANK", 0)) == cfg.fault_rank
    return Data(num_samples, stuck=stuck)


def _inject(kind):
    if kind == "raise":
        raise ValueError(f"injected failure at step {_calls['n']}")
    if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "hang":
        while True:
            time.sleep(3600)
    if kind == "exit0":
        os._exit(0)
    if kind == "stubborn":
        child = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                                  "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
        with open(os.path.join(tempfile.gettempdir(), "stubborn.pid"), "w") as f:
            f.write(str(child.pid))
        raise ValueError(f"injected failure at step {_calls['n']}, a stubborn child left running")
    raise ValueError(f"unknown --fault {kind!r}")


def loss_fn(model, batch):
    _calls["n"] += 1
    attempt = int(os.environ.get("DLAUNCH_ATTEMPT", "0"))
    if (int(os.environ.get("RANK", 0)) == _cfg["fault_rank"] and _calls["n"] == _cfg["fault_step"]
            and _cfg["fault_attempt"] in (-1, attempt)):
        _inject(_cfg["fault"])
    x, y = batch
    return F.cross_entropy(model(x), y)

"""A rank's failure line leads with the cause (runtime.recorder.error_line): the disk's error
wherever a write failed, a DataLoader worker's own exception, a stream that ran dry said as such,
a dataset too large to index refused before its sampler runs the host out of memory, DataLoader
workers under a TMPDIR too long for their sockets refused before their first batch hangs."""

from __future__ import annotations

import errno
import json
import multiprocessing.util
import os
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from launcher.errors import LaunchError, WorkloadError
from launcher.rundir import RunPaths
from launcher.runspec import LaunchSpec
from launcher.runtime.context import RankContext
from launcher.runtime.loader import (
    MAX_INDEXED_SAMPLES,
    check_worker_sockets,
    fetch,
    make_loader,
    worker_socket_problem,
)
from launcher.runtime.recorder import RankRecorder, error_line
from launcher.runtime.window import Clock
from launcher.workload import load_workload

from tests.helpers import REPO


class CheckpointLike(BaseException):
    """torch.distributed.checkpoint's CheckpointException: its message names only the ranks; each
    rank's exception sits in `failures` (rank -> (exception, stack))."""

    def __init__(self, failures: dict) -> None:
        super().__init__(f"CheckpointException ranks:{failures.keys()}")
        self.failures = failures


def _full_disk() -> OSError:
    return OSError(errno.ENOSPC, "No space left on device", "/ckpt/step-8/__0_0.distcp")


def test_a_full_disk_leads_wherever_the_write_failed():
    assert error_line(_full_disk()) == "ENOSPC: No space left on device writing /ckpt/step-8/__0_0.distcp"
    # a distributed checkpoint's exception names the ranks; their disk error comes first
    line = error_line(CheckpointLike({0: (_full_disk(), None), 1: (_full_disk(), None)}))
    assert line.startswith("ENOSPC: No space left on device writing /ckpt/") and "CheckpointLike" in line
    # raised from it: the chain is followed
    try:
        try:
            raise OSError(errno.EROFS, "Read-only file system", "/runs/x/rank-0.jsonl")
        except OSError as e:
            raise RuntimeError("could not write the records") from e
    except RuntimeError as wrapped:
        assert error_line(wrapped).startswith("EROFS: Read-only file system writing /runs/x/rank-0.jsonl")
    assert error_line(ValueError("bad value")) == "ValueError: bad value"


class Broken(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        raise ValueError(f"sample {i} is corrupt")


def test_a_dataloader_workers_exception_is_named_with_its_message():
    with pytest.raises(ValueError) as caught:
        next(iter(DataLoader(Broken(), num_workers=1)))
    assert str(caught.value).startswith("Caught ValueError in DataLoader worker process 0")
    assert error_line(caught.value) == "ValueError: sample 0 is corrupt (in DataLoader worker process 0)"


def test_a_stream_that_runs_dry_says_so_and_the_summary_carries_the_line(tmp_path):
    with pytest.raises(WorkloadError, match="the workload's data ran dry: its dataset or stream ended"):
        fetch(iter([torch.zeros(2)]), 2, torch.device("cpu"), Clock("cpu"))
    recorder = RankRecorder(str(tmp_path), 0, {"run_id": "r"})
    recorder.finish("failed", error=CheckpointLike({1: (_full_disk(), None)}))
    summary = json.loads(RunPaths(root=tmp_path).summary(0).read_text())
    assert summary["error"].startswith("ENOSPC: No space left on device") and "Traceback" not in summary["error"]


def test_a_dataset_too_large_to_index_fails_at_once_naming_steps_and_the_fix():
    workload = load_workload(REPO / "workloads" / "mlp.py")
    ctx = RankContext(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, host="h",
                      device_type="cpu")

    def loader(steps: int) -> DataLoader:
        spec = LaunchSpec(workload=str(REPO / "workloads" / "mlp.py"), run_id="r", run_dir="/r", steps=steps,
                          micro_batch=8, grad_accum=1, strategy="ddp", precision="fp32")
        return make_loader(workload, spec, ctx)

    # --steps 1e8 passes its bound, but the sampler would list 8e8 indices (~27 GiB) per rank
    with pytest.raises(WorkloadError, match=r"holds 800,000,000 samples \(--steps 100,000,000 x global batch 8\)"
                                            r".*~27 GiB.*IterableDataset"):
        loader(10**8)
    assert len(loader(MAX_INDEXED_SAMPLES // 8).dataset) == MAX_INDEXED_SAMPLES  # type: ignore[arg-type]


# In a fresh process under TMPDIR: torch's own DataLoader with one worker (3 s timeout), then
# make_loader and a script's DataLoader under the bootstrap's hooks.
_UNDER_TMPDIR = """
import tempfile
import torch
from torch.utils.data import DataLoader, TensorDataset
from launcher.errors import LaunchError
from launcher.runspec import LaunchSpec
from launcher.runtime.bootstrap import AutoMeter, install
from launcher.runtime.context import RankContext
from launcher.runtime.loader import make_loader
from launcher.workload import load_workload
data = TensorDataset(torch.zeros(8, 2))
DIR = tempfile.mkdtemp()  # the script's bootstrap beats into it
try:
    next(iter(DataLoader(data, batch_size=2, num_workers=1, timeout=3)))
    print("torch: ok")
except RuntimeError as e:
    print("torch:", "timed out" if "timed out" in str(e) else e)
spec = LaunchSpec(workload=WORKLOAD, run_id="r", run_dir="/r", steps=2, micro_batch=2, grad_accum=1,
                  strategy="ddp", precision="fp32", num_workers=1)
ctx = RankContext(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, host="h",
                  device_type="cpu")
for name, first_batch in [("make_loader", lambda: next(iter(make_loader(load_workload(WORKLOAD), spec, ctx)))),
                          ("script", lambda: (install(AutoMeter(DIR)), next(iter(DataLoader(data, num_workers=1)))))]:
    try:
        first_batch()
        print(name + ": ok")
    except LaunchError as e:
        print(name + ":", e)
"""


@pytest.mark.parametrize("long", [False, True])
def test_dataloader_workers_under_a_tmpdir_too_long_for_their_sockets_fail_at_once(tmp_path, long):
    # 95 characters: multiprocessing's pymp-XXXXXXXX/listener-XXXXXXXX takes the socket's path to 127
    tmpdir = tmp_path / ("t" * (95 - len(str(tmp_path)) - 1)) if long else tmp_path
    tmpdir.mkdir(exist_ok=True)
    code = f"WORKLOAD = {str(REPO / 'workloads' / 'mlp.py')!r}\n" + _UNDER_TMPDIR
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TMPDIR": str(tmpdir), "OMP_NUM_THREADS": "1"})
    lines = dict(x.split(": ", 1) for x in done.stdout.splitlines())
    if not long:
        assert lines == {"torch": "ok", "make_loader": "ok", "script": "ok"}, done.stdout + done.stderr
        return
    assert lines["torch"] == "timed out", done.stdout + done.stderr  # what the check prevents: a hang
    for name in ("make_loader", "script"):
        assert lines[name].startswith("TMPDIR is too long for DataLoader workers") and "127 bytes" in lines[name] \
            and "TMPDIR=/tmp" in lines[name] and "--num-workers 0" in lines[name], done.stdout


def test_the_socket_limit_is_sun_paths():
    assert worker_socket_problem("/tmp/pymp-abcdefgh") is None
    edge = "/" + "d" * (107 - len("/listener-xxxxxxxx") - 1)  # 107 bytes with the socket's name: fits
    assert worker_socket_problem(edge) is None
    assert "108 bytes" in (worker_socket_problem(edge + "d") or "")


def test_no_workers_no_sockets(monkeypatch):
    """The check asks about the sockets only where workers would open them."""
    monkeypatch.setattr(multiprocessing.util, "get_temp_dir", lambda: "/" + "d" * 120)
    monkeypatch.setattr(torch.multiprocessing, "get_sharing_strategy", lambda: "file_descriptor")
    check_worker_sockets(0)
    with pytest.raises(LaunchError, match="TMPDIR is too long"):
        check_worker_sockets(2)


def test_a_plain_scripts_uncaught_error_reads_as_python_script_prints_it(tmp_path):
    # the bootstrap runs the script through runpy: its frames and runpy's are not the script's
    script = tmp_path / "train.py"
    script.write_text("import sys\nhooked = sys.excepthook\n"
                      "sys.excepthook = lambda t, e, tb: (print('hook saw', e, file=sys.stderr), hooked(t, e, tb))\n"
                      "def step():\n    raise ValueError('bad batch')\nstep()\n")
    done = subprocess.run([sys.executable, "-m", "launcher.runtime.bootstrap", str(script)], cwd=REPO,
                          env={k: v for k, v in os.environ.items() if k != "DLAUNCH_RUN_DIR"},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "hook saw bad batch", "Traceback (most recent call last):", f'  File "{script}", line 6, in <module>',
        "    step()", f'  File "{script}", line 5, in step', "    raise ValueError('bad batch')",
        "ValueError: bad batch"], done.stderr

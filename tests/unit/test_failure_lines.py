"""A rank's failure line leads with the cause (runtime.recorder.error_line): the disk's error
wherever a write failed, a DataLoader worker's own exception, a stream that ran dry said as such,
a dataset too large to index refused before its sampler runs the host out of memory."""

from __future__ import annotations

import errno
import json

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from launcher.errors import WorkloadError
from launcher.rundir import RunPaths
from launcher.runspec import LaunchSpec
from launcher.runtime.context import RankContext
from launcher.runtime.loader import MAX_INDEXED_SAMPLES, fetch, make_loader
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

"""The sync-off passes of the communication measurement run the same number of times on every
rank, though each rank's own steps differ: FSDP's sync-off pass all-gathers, and ranks running
different counts hang (seen once at the end of a 2-rank FSDP run of an HF model).

Two real processes over gloo; the pass is a sleep and an all-reduce, as FSDP's is compute and a
collective.
"""

from __future__ import annotations

import datetime
import json
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from launcher.runtime.calibrate import GradSizes, measure
from launcher.runtime.context import RankContext

pytestmark = pytest.mark.distributed


def _rank(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    ctx = RankContext(rank=rank, local_rank=rank, world_size=2, local_world_size=2, node_rank=0,
                      host=socket.gethostname(), device_type="cpu")

    def sync_off_pass() -> None:  # compute, then a collective every rank must join
        time.sleep(0.1)
        dist.all_reduce(torch.ones(4))

    # rank 0's steps took 1 s, rank 1's 1 ms: each alone would choose another pass count
    record = measure([1.0] if rank == 0 else [0.001], sync_off_pass, ctx=ctx,
                     sizes=GradSizes(local_bytes=4096, unsharded_bytes=0))
    Path(out, f"rank-{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


def test_every_rank_runs_as_many_sync_off_passes(tmp_path: Path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path / "store"), str(tmp_path))) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=90)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "a rank hung in the calibration"
    assert [p.exitcode for p in procs] == [0, 0]
    records = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    passes = [r["nosync_passes"] for r in records]
    assert passes[0] == passes[1] > 1, records
    assert [r["sync_step_s"] for r in records] == [1.0, 0.001]  # each rank keeps its own step

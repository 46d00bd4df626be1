"""Measured communication: what a step loses to gradient sync, and the all-reduce bandwidth.

Both are measured after the last training step, while the processes are warm:

- Sync on: every training step times its forward and backward (gradient sync included, data
  loading and the optimizer step not) on the step clock (runtime.window: CUDA events read at
  window ends, perf_counter on CPU). The median over the steady steps is `sync_step_s`; it
  costs nothing extra.
- Sync off: the last step's micro-batches again, with gradient sync off (DDP `no_sync`, FSDP2
  `set_requires_gradient_sync(False)`) and no optimizer step: `nosync_step_s`, the median of
  the passes. `exposed_comm_s` = sync_step_s - nosync_step_s. For FSDP2, sync-off still
  all-gathers parameters, so the number is the exposed gradient reduction alone.
- Bandwidth: an all-reduce of the gradients' size (nccl-tests definitions): algbw = S / t,
  busbw = algbw x 2(n-1)/n, from the faster of `ALLREDUCE_REPEATS` all-reduces (the group is
  warm after training, and a busy host only ever adds time).

Why after training: a calibration before step 1 (sync off / on pairs, then an all-reduce
benchmark) held the first step back by 1.8-2.7 s on a 2-core CPU. Sync-off passes between
training steps would land inside the steady wall-clock window and lower the measured
throughput, and sync-off *training* steps would let DDP replicas diverge. After the last step
nothing waits for the measurement but the run's end, training is bit-for-bit what it is
without it (no extra passes or RNG draws before any optimizer step), and the sync-on side
comes from the steps themselves. The cost is one sync-off pass (more, up to `MAX_PASSES`, only
while they fit in one median step or in `CHEAP_S`: short steps get a steadier median) and two
all-reduces of the gradients' size.
A preempted or failed run skips it.

Never imports cli, backends, jobs or report; torch only inside functions (see
runtime/__init__).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

from launcher.runtime.context import RankContext

log = logging.getLogger(__name__)

MAX_PASSES = 3
# below this a step's worth of passes is too short to matter: take MAX_PASSES for a steadier median
CHEAP_S = 0.05
ALLREDUCE_REPEATS = 2


def _timed(fn: Callable[[], object], cuda: bool) -> float:
    # deferred: torch loads only once the rank's recorder runs (see runtime/__init__)
    import torch

    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t


def _max_over_ranks(value: float, device: Any) -> float:
    """The largest `value` of any rank (one tiny all-reduce)."""
    # deferred: torch loads only once the rank's recorder runs (see runtime/__init__)
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def passes_within(step_s: float, pass_s: float, limit: int = MAX_PASSES) -> int:
    """How many sync-off passes of `pass_s` fit in one step of `step_s` (or in `CHEAP_S`,
    when that is longer), at least 1 and at most `limit`."""
    if pass_s <= 0:
        return limit
    return max(1, min(limit, int(max(step_s, CHEAP_S) / pass_s)))


def exposed_comm(sync_step_s: list[float], sync_off_pass: Callable[[], None], *,
                 ctx: RankContext) -> dict[str, float | int]:
    """Exposed communication per step from the steps' sync-on times and sync-off passes.

    `sync_step_s`: forward+backward seconds of the steady steps (sync on); `sync_off_pass`
    runs the same micro-batches with sync off and drops the gradients. Every rank must call
    this (the pass count is agreed in one all-reduce: FSDP's sync-off pass still all-gathers).
    """
    cuda = ctx.device_type == "cuda"
    sync = statistics.median(sync_step_s)
    off = [_timed(sync_off_pass, cuda)]
    # the same count on every rank: from the slowest rank's first pass
    more = passes_within(sync, _max_over_ranks(off[0], ctx.device())) - 1
    off += [_timed(sync_off_pass, cuda) for _ in range(more)]
    nosync = statistics.median(off)
    return {"nosync_step_s": nosync, "sync_step_s": sync, "exposed_comm_s": max(0.0, sync - nosync),
            "sync_steps": len(sync_step_s), "nosync_passes": len(off)}


def allreduce_bandwidth(nbytes: int, device: Any, world_size: int,
                        repeats: int = ALLREDUCE_REPEATS) -> dict[str, float]:
    """Time an all-reduce of `nbytes` (fp32) and derive algbw / busbw in GB/s."""
    # deferred: torch loads only once the rank's recorder runs (see runtime/__init__)
    import torch
    import torch.distributed as dist

    buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
    cuda = device.type == "cuda"
    t = min(_timed(lambda: dist.all_reduce(buf), cuda) for _ in range(repeats))
    algbw = buf.numel() * 4 / t / 1e9
    return {"allreduce_bytes": buf.numel() * 4, "allreduce_s": t, "algbw_gb_s": algbw,
            "busbw_gb_s": algbw * 2 * (world_size - 1) / world_size}


def measure(sync_step_s: list[float], sync_off_pass: Callable[[], None], *, ctx: RankContext,
            grad_bytes: int) -> dict[str, Any]:
    """The `comm` record: exposed communication and all-reduce bandwidth (every rank calls it)."""
    record: dict[str, Any] = {"kind": "comm"}
    record.update(exposed_comm(sync_step_s, sync_off_pass, ctx=ctx))
    record.update(allreduce_bandwidth(grad_bytes, ctx.device(), ctx.world_size))
    return record

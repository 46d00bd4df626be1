"""Measured communication: what a step loses to gradient sync, and the all-reduce bandwidth.

Exposed communication comes from a calibration window after warm-up: the same forward and
backward on one fixed batch, alternately with gradient sync off (DDP `no_sync`, FSDP2
`set_requires_gradient_sync(False)`) and on; the difference of the medians is what the step
loses to synchronisation. No optimizer step runs in the window (gradients are dropped), so
training is unchanged. For FSDP2, sync-off still all-gathers parameters, so the number is the
exposed gradient reduction alone.

Bandwidth comes from an all-reduce of the gradients' size (nccl-tests definitions):
algbw = S / t, busbw = algbw x 2(n-1)/n.

Never imports cli, backends, jobs or report; torch only inside functions (see
runtime/__init__).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

CALIBRATION_PAIRS = 3
ALLREDUCE_REPEATS = 5


def _timed(fn: Callable[[], None], cuda: bool) -> float:
    # deferred: torch loads only once the rank's recorder runs (see runtime/__init__)
    import torch

    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t


def exposed_comm(forward_backward: Callable[[], None], no_sync: Callable[[], Any],
                 zero_grad: Callable[[], None], *, cuda: bool,
                 pairs: int = CALIBRATION_PAIRS) -> dict[str, float]:
    """Median step time with sync off and on, and their difference (seconds)."""
    off, on = [], []
    for _ in range(pairs):
        with no_sync():
            off.append(_timed(forward_backward, cuda))
        zero_grad()
        on.append(_timed(forward_backward, cuda))
        zero_grad()
    nosync, sync = statistics.median(off), statistics.median(on)
    return {"nosync_step_s": nosync, "sync_step_s": sync, "exposed_comm_s": max(0.0, sync - nosync)}


def allreduce_bandwidth(nbytes: int, device: Any, world_size: int,
                        repeats: int = ALLREDUCE_REPEATS) -> dict[str, float]:
    """Time an all-reduce of `nbytes` (fp32) and derive algbw / busbw in GB/s."""
    # deferred: torch loads only once the rank's recorder runs (see runtime/__init__)
    import torch
    import torch.distributed as dist

    buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
    cuda = device.type == "cuda"
    dist.all_reduce(buf)  # connection set-up is not bandwidth
    times = [_timed(lambda: dist.all_reduce(buf), cuda) for _ in range(repeats)]
    t = statistics.median(times)
    algbw = buf.numel() * 4 / t / 1e9
    return {"allreduce_bytes": buf.numel() * 4, "allreduce_s": t, "algbw_gb_s": algbw,
            "busbw_gb_s": algbw * 2 * (world_size - 1) / world_size}

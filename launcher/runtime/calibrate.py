"""Measured communication: what a step loses to gradient sync, and the all-reduce bandwidth.

Both are measured after the last training step, while the processes are warm:

- Sync on: every training step times its forward and backward (gradient sync included, data
  loading and the optimizer step not) on the step clock (runtime.window). The median over the
  steady steps is `sync_step_s`; it costs nothing extra.
- Sync off: the last step's micro-batches again, with gradient sync off (DDP `no_sync`, FSDP2
  `set_requires_gradient_sync(False)`) and no optimizer step: `nosync_step_s`, the median of
  the passes. `exposed_comm_s` = sync_step_s - nosync_step_s. For FSDP2, sync-off still
  all-gathers parameters, so the number is the exposed gradient reduction alone.
- Bandwidth: an all-reduce of the gradient bytes this rank holds (`grad_sizes`; the largest
  over ranks, since an all-reduce needs one size everywhere) with nccl-tests definitions:
  algbw = S / t, busbw = algbw x 2(n-1)/n, from the faster of `ALLREDUCE_REPEATS` all-reduces
  (a busy host only ever adds time).

Why after training: a calibration before step 1 held the first step back by 1.8-2.7 s on a
2-core CPU; sync-off passes between training steps would lower the measured throughput, and
sync-off *training* steps would let DDP replicas diverge. After the last step training is
bit-for-bit what it is without it, for one sync-off pass (up to `MAX_PASSES`: `passes_within`)
and two all-reduces of the gradients' size. A preempted or failed run skips it.

The calibration never fails a run: an error in it (an out-of-memory above all) leaves the
`comm` record without the numbers it could not measure, with `error` (this rank's failure,
"<part>: <Type>: <message>") and `skipped` (what is missing and why, the same on every rank).
Since it is full of collectives, every rank must take the same path through it: each part that
can fail on one rank alone (the device-memory check, a sync-off pass, allocating the benchmark
buffer) is followed by one small all-reduce that tells every rank whether any failed, and then
all go on or all stop. On CUDA the memory check comes first (`shortfall`), so a pass whose
all-gathers one rank would leave by running out of memory is not started. An error on one rank
alone *inside* a collective of a pass (the others wait in it) is the hang watcher's, as in
training. On CUDA an out-of-memory error empties the allocator's cache before anything else.

Never imports cli, backends, jobs or report; torch at module level (see runtime/__init__).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from launcher.runtime import tp_comm
from launcher.runtime.context import RankContext
from launcher.runtime.window import Window
from launcher.runtime.wrap import Wrapped

log = logging.getLogger(__name__)

T = TypeVar("T")

MAX_PASSES = 3
# below this a step's worth of passes is too short to matter: take MAX_PASSES for a steadier median
CHEAP_S = 0.05
ALLREDUCE_REPEATS = 2
GRAD_BYTES = 4  # the benchmark all-reduces fp32, as the gradients are reduced
# of the memory the allocator could still hand out, what the calibration may plan to use: the
# estimate of a pass is rough (fragmentation, a collective's own buffers)
MEMORY_MARGIN = 0.9


@dataclass(frozen=True, kw_only=True)
class GradSizes:
    """fp32 gradient bytes of this rank's trainable parameters."""

    local_bytes: int  # what this rank holds and reduces: its shards (FSDP2), or all (DDP)
    unsharded_bytes: int  # what a sync-off pass adds on top: the unsharded gradients (FSDP2)


def grad_sizes(params: Iterable[torch.Tensor]) -> GradSizes:
    """This rank's gradient bytes: a DTensor (FSDP2) counts its local shard (its `numel()` is the
    global size), a plain tensor counts whole. Unsharded: FSDP's gathered gradients."""
    # deferred: 0.8 s of imports, which DDP and FSDP2 have made by now but a one-process run,
    # which never calibrates, has not (see runtime/__init__)
    from torch.distributed.tensor import DTensor

    local = unsharded = 0
    for p in params:
        n = p.numel()
        if isinstance(p, DTensor):
            here = p.to_local().numel()
            local += here
            # what FSDP unshards: its data-parallel shards, gathered; a tensor-parallel split
            # ("tp" mesh dimension) stays split in the sync-off pass
            mesh, tp = p.device_mesh, 1
            names = mesh.mesh_dim_names or ()
            if "tp" in names:
                tp_dim = names.index("tp")
                if not p.placements[tp_dim].is_replicate():
                    tp = mesh.size(tp_dim)
            unsharded += max(0, n // tp - here)
        else:
            local += n
    return GradSizes(local_bytes=local * GRAD_BYTES, unsharded_bytes=unsharded * GRAD_BYTES)


def shortfall(need_bytes: int, free_bytes: int | None) -> str | None:
    """Why a calibration needing `need_bytes` must not start with `free_bytes` to hand out
    (None on CPU: host memory is not checked), or None when it fits within MEMORY_MARGIN."""
    if free_bytes is None or need_bytes <= free_bytes * MEMORY_MARGIN:
        return None
    return (f"needs about {need_bytes / 2**30:.2f} GiB of device memory, "
            f"{free_bytes / 2**30:.2f} GiB free")


def _need_and_free(sizes: GradSizes, device: torch.device) -> tuple[int, int | None]:
    """(bytes needed, bytes the allocator can hand out) on CUDA, else (0, None): a sync-off pass needs
    a step's transient bytes plus FSDP2's unsharded gradients, the benchmark its buffer."""
    if device.type != "cuda":
        return 0, None
    allocated = torch.cuda.memory_allocated(device)
    transient = max(0, torch.cuda.max_memory_allocated(device) - allocated)
    free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - allocated
    return max(transient + sizes.unsharded_bytes, sizes.local_bytes), free


def _timed(fn: Callable[[], object], cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t


def passes_within(step_s: float, pass_s: float, limit: int = MAX_PASSES) -> int:
    """How many sync-off passes of `pass_s` fit in max(`step_s`, `CHEAP_S`), from 1 to `limit`."""
    if pass_s <= 0:
        return limit
    return max(1, min(limit, int(max(step_s, CHEAP_S) / pass_s)))


def allreduce_bandwidth(buf: torch.Tensor, world_size: int, repeats: int = ALLREDUCE_REPEATS) -> dict[str, float]:
    """Time an all-reduce of `buf` (fp32, allocated by `measure`): algbw / busbw in GB/s."""
    cuda = buf.device.type == "cuda"
    t = min(_timed(lambda: dist.all_reduce(buf), cuda) for _ in range(repeats))
    nbytes = buf.numel() * buf.element_size()
    algbw = nbytes / t / 1e9
    return {"allreduce_bytes": nbytes, "allreduce_s": t, "algbw_gb_s": algbw,
            "busbw_gb_s": algbw * 2 * (world_size - 1) / world_size}


class _Calibration:
    """One rank's way through `measure`: its record, and whether this rank has failed."""

    def __init__(self, ctx: RankContext) -> None:
        self.ctx = ctx
        self.device = ctx.device()
        self.cuda = ctx.device_type == "cuda"
        self.record: dict[str, Any] = {"kind": "comm"}
        self.failed = False

    def fail(self, part: str, why: str) -> None:
        """Record this rank's first failure: `error` is "<part>: <why>"."""
        if not self.failed:
            self.record["error"] = f"{part}: {why}"
            log.warning("rank %d: communication calibration: %s", self.ctx.rank, self.record["error"])
        self.failed = True

    def attempt(self, part: str, fn: Callable[[], T]) -> T | None:
        """`fn()`, or None once its error is recorded; on CUDA an out-of-memory error also
        frees the allocator's cache (the error and its traceback's tensors are gone by then)."""
        oom = False
        try:
            return fn()
        except Exception as e:  # any error: the run has trained; its status stays ok
            self.fail(part, f"{type(e).__name__}: {e}".strip())
            oom = isinstance(e, torch.OutOfMemoryError)
        if oom and self.cuda:
            torch.cuda.empty_cache()
        return None

    def agree(self, missing: str, *values: float) -> list[float] | None:
        """One all-reduce (MAX) of this rank's failure flag and `values`: their maxima over the
        ranks, or None on every rank when any has failed (`skipped` then says `missing`, and why)."""
        flags = torch.tensor([float(self.failed), *values], dtype=torch.float64, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        failed, *out = flags.tolist()
        if not failed:
            return out
        why = "this rank failed (see error)" if self.failed else "another rank failed"
        self.record["skipped"] = f"{missing} not measured: {why}"
        return None


def measure(sync_step_s: list[float], sync_off_pass: Callable[[], None], *, ctx: RankContext,
            sizes: GradSizes) -> dict[str, Any]:
    """The `comm` record (every rank calls it; never raises an Exception): `sync_step_s`, the
    steady steps' forward+backward seconds; `sync_off_pass` runs the same micro-batches with
    sync off and drops the gradients; `sizes`, `grad_sizes` of the trainable parameters."""
    cal = _Calibration(ctx)
    need, free = _need_and_free(sizes, cal.device)
    if (short := shortfall(need, free)) is not None:
        cal.fail("device memory", short)
    if cal.agree("exposed communication and all-reduce bandwidth") is None:
        return cal.record
    sync = statistics.median(sync_step_s)
    first = cal.attempt("sync-off pass", lambda: _timed(sync_off_pass, cal.cuda))
    # one all-reduce: the pass count must be the same on every rank (FSDP's sync-off pass
    # all-gathers: ranks running different counts hang), so it comes from maxima over the ranks
    # (the longest step, the slowest first pass), and the largest shard is the benchmark's size
    agreed = cal.agree("exposed communication and all-reduce bandwidth", first or 0.0, float(sizes.local_bytes), sync)
    if first is None or agreed is None:
        return cal.record
    slowest, nbytes, longest_step = agreed
    off = [first]
    for _ in range(passes_within(longest_step, slowest) - 1):
        if (t := cal.attempt("sync-off pass", lambda: _timed(sync_off_pass, cal.cuda))) is None:
            break
        off.append(t)
    nosync = statistics.median(off)
    cal.record.update({"nosync_step_s": nosync, "sync_step_s": sync, "exposed_comm_s": max(0.0, sync - nosync),
                       "sync_steps": len(sync_step_s), "nosync_passes": len(off)})
    buf = None if cal.failed else cal.attempt("all-reduce buffer", lambda: _zeros(int(nbytes), cal.device))
    # `agree` first, on every rank (a collective); past it no rank has failed: `buf` is there
    if cal.agree("all-reduce bandwidth") is None or buf is None:
        return cal.record
    bw = cal.attempt("all-reduce benchmark", lambda: allreduce_bandwidth(buf, ctx.world_size))
    if bw is not None:
        cal.record.update(bw)
    return cal.record


def _zeros(nbytes: int, device: torch.device) -> torch.Tensor:
    """The benchmark's buffer: `nbytes` of fp32 zeros (at least one element)."""
    return torch.zeros(max(1, nbytes // GRAD_BYTES), dtype=torch.float32, device=device)


def comm_record(window: Window, wrapped: Wrapped, replay: Callable[[], object],
                zero_grad: Callable[[], None], params: Sequence[torch.Tensor], ctx: RankContext,
                *, tp: int = 1) -> dict[str, Any]:
    """The `comm` record after the last step: `replay` (the last step's micro-batches) runs again
    with gradient sync off, `zero_grad` drops their gradients, `params` are the trainable ones.
    With `tp` > 1 sync-off leaves the TP collectives on: `exposed_comm_s` is the dp dimension's
    (`exposed_comm_dims`), and on CPU one more pass times TP's own (runtime.tp_comm)."""

    def sync_off_pass() -> None:
        try:
            with wrapped.no_sync():
                replay()
        finally:  # a failed pass's gradients go too (the calibration goes on without it)
            zero_grad()

    record = measure(window.fwd_bwd_times(), sync_off_pass, ctx=ctx, sizes=grad_sizes(params))
    if tp > 1:
        record.update(tp=tp, dp=ctx.world_size // tp, exposed_comm_dims=["dp"])
        if ctx.device_type == "cpu" and wrapped.tp_group is not None:
            record.update(tp_comm.tp_comm_s(sync_off_pass, wrapped.tp_group))
        else:
            record["tp_comm_skipped"] = ("not measured on CUDA: NCCL collectives run "
                                         "asynchronously (a --profile trace shows them)")
    return record

"""What every rank of `dlaunch doctor` measures (runtime.doctor_rank runs it): a GEMM, a large
copy and all-reduces, each timed on this rank's device.

  GEMM       C = A @ B, square n x n, in the run's precision: 2 n^3 FLOP per repetition
  copy       dst.copy_(src): bytes read + written per repetition (HBM on CUDA, memory on CPU)
  all-reduce sum over the node's ranks, then (several nodes) over every rank; busbw =
             algbw x 2 (n - 1) / n (nccl-tests), n the ranks taking part

Each is the median of its timed repetitions (CUDA events on GPUs, the wall clock on CPUs),
after warm-up. Every rank of a node runs each check at the same time, as training does
(barriers between checks); on CPUs each rank has the threads `OMP_NUM_THREADS` gives it.

Test hook: DLAUNCH_DOCTOR_SLOW_RANK=R makes global rank R sleep SLOW_FACTOR - 1 times as long as
each timed GEMM and copy repetition took, inside the timed region, so R measures 1/SLOW_FACTOR
of its real rates without taking resources from the other ranks (the tests check that a slow
rank is named). It is recorded (`slowed`), never for real runs.

Never imports cli, backends, jobs or report; torch at module level, imported once the rank's
recorder beats (see runtime/__init__).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from launcher.runtime.context import RankContext, init_distributed
from launcher.runtime.recorder import RankRecorder

SLOW_RANK_ENV = "DLAUNCH_DOCTOR_SLOW_RANK"
SLOW_FACTOR = 4
# a collective stuck this long fails the rank (the launcher's hang watcher acts sooner)
COLLECTIVE_TIMEOUT_S = 120.0
MIB = 1024**2
GIB = 1024**3
# CUDA: an 8192^3 GEMM runs near the large-GEMM rate on every datacenter GPU (~1.4 ms bf16 on
# an H100); 1 GiB copied (2 GiB moved) and a 512 MiB all-reduce are far past every cache and
# latency term; 20 timed repetitions of each take well under a second on an H100
CUDA_GEMM_N = 8192
CUDA_COPY_BYTES = GIB
CUDA_ALLREDUCE_BYTES = 512 * MIB
CUDA_REPS = 20
# CPU: 1024^3 (2048^3 from 8 threads per rank) takes ~25 ms on one Zen 4 core in fp32; the copy
# streams 64 MiB per thread (source + destination, the CPU probe's largest working set, past the
# last-level cache of most hosts); 16 MiB all-reduced over gloo takes ~12 ms between two ranks
CPU_GEMM_N = 1024
CPU_GEMM_N_MANY_THREADS = 2048
CPU_COPY_BYTES_PER_THREAD = 32 * MIB
CPU_ALLREDUCE_BYTES = 16 * MIB
# CPU repetitions fill about this long (between the bounds); the all-reduce's count is fixed,
# since every rank must run the same number of collectives
CPU_TARGET_S = 0.4
CPU_MIN_REPS, CPU_MAX_REPS = 5, 40
CPU_ALLREDUCE_REPS = 10
WARMUP = 2
PHASES = ("started", "process group", "gemm", "copy", "allreduce node", "allreduce world")


def pick_precision(requested: str, device: str, capability: tuple[int, int] | None) -> str:
    """`auto`: bf16 on GPUs of compute capability >= 8.0, fp32 below and on CPUs."""
    if requested != "auto":
        return requested
    return "bf16" if device == "cuda" and capability is not None and capability >= (8, 0) else "fp32"


def busbw(nbytes: float, seconds: float, ranks: int) -> float:
    """All-reduce bus bandwidth in bytes/s (nccl-tests): algbw x 2 (n - 1) / n."""
    return nbytes / seconds * 2 * (ranks - 1) / ranks


def slowed_rank(env: dict[str, str] | None = None) -> int | None:
    """The rank the test hook slows (DLAUNCH_DOCTOR_SLOW_RANK), or None."""
    raw = (os.environ if env is None else env).get(SLOW_RANK_ENV, "").strip()
    return int(raw) if raw.isdigit() else None


class _Clock:
    """Times repetitions of a function on one device: CUDA events or the wall clock."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def once(self, fn: Callable[[], Any]) -> float:
        """Seconds of one call, synchronized."""
        self.sync()
        t = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t

    def reps(self, fn: Callable[[], Any], reps: int) -> list[float]:
        """Seconds of each of `reps` calls."""
        if not self.cuda:
            return [self.once(fn) for _ in range(reps)]
        ev = torch.cuda.Event
        pairs = [(ev(enable_timing=True), ev(enable_timing=True)) for _ in range(reps)]
        self.sync()
        for start, end in pairs:
            start.record()
            fn()
            end.record()
        self.sync()
        return [start.elapsed_time(end) / 1e3 for start, end in pairs]


def _timed(clock: _Clock, fn: Callable[[], Any], *, fixed_reps: int | None, slowed: bool = False) -> list[float]:
    """Warm-up, then the timed repetitions: `fixed_reps`, or (CPU) as many as fill
    CPU_TARGET_S judged by the last warm-up call; `slowed`: under the test hook (`_slowed`)."""
    fn = _slowed(fn, clock) if slowed else fn
    took = 0.0
    for _ in range(WARMUP):
        took = clock.once(fn)
    reps = fixed_reps or min(CPU_MAX_REPS, max(CPU_MIN_REPS, math.ceil(CPU_TARGET_S / max(took, 1e-6))))
    return clock.reps(fn, reps)


def _summary(samples: list[float], work: float, **extra: Any) -> dict[str, Any]:
    median = statistics.median(samples)
    return {"reps": len(samples), "median_s": median, "min_s": min(samples), "max_s": max(samples),
            "rate": work / median, **extra}


def _slowed(fn: Callable[[], Any], clock: _Clock) -> Callable[[], None]:
    """The test hook: `fn`, then a sleep of SLOW_FACTOR - 1 times what it took."""

    def run() -> None:
        t = time.perf_counter()
        fn()
        clock.sync()
        time.sleep((SLOW_FACTOR - 1) * (time.perf_counter() - t))

    return run


def _gemm(clock: _Clock, device: torch.device, precision: str, n: int, slowed: bool,
          fixed_reps: int | None) -> dict[str, Any]:
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    samples = _timed(clock, lambda: torch.mm(a, b, out=c), fixed_reps=fixed_reps, slowed=slowed)
    return _summary(samples, 2.0 * n**3, n=n, unit="FLOP/s")


def _copy(clock: _Clock, device: torch.device, nbytes: int, slowed: bool, fixed_reps: int | None) -> dict[str, Any]:
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    moved = 2 * src.numel() * 4  # read + written
    samples = _timed(clock, lambda: dst.copy_(src), fixed_reps=fixed_reps, slowed=slowed)
    return _summary(samples, float(moved), bytes=moved, unit="B/s")


def _allreduce(clock: _Clock, device: torch.device, nbytes: int, group: dist.ProcessGroup | None,
               ranks: int, reps: int) -> dict[str, Any]:
    buf = torch.ones(nbytes // 4, device=device)
    size = buf.numel() * 4
    dist.barrier(group=group)
    samples = _timed(clock, lambda: dist.all_reduce(buf, group=group), fixed_reps=reps)
    out = _summary(samples, float(size), bytes=size, ranks=ranks, unit="B/s")
    out["algbw"] = out.pop("rate")
    out["busbw"] = busbw(size, out["median_s"], ranks)
    return out


def _device_name(ctx: RankContext) -> tuple[str, tuple[int, int] | None]:
    if ctx.device_type == "cuda":
        return (torch.cuda.get_device_name(ctx.local_rank), torch.cuda.get_device_capability(ctx.local_rank))
    from launcher.hardware.detect import cpu_info  # psutil and /proc: only here

    return cpu_info().model, None


def measure(ctx: RankContext, recorder: RankRecorder, requested: str) -> dict[str, Any]:
    """Every check of this rank; the `doctor` part of its summary."""
    init_distributed(ctx, timeout_s=COLLECTIVE_TIMEOUT_S)
    recorder.heartbeat(PHASES.index("process group"))
    cuda = ctx.device_type == "cuda"
    device = ctx.device()
    clock = _Clock(ctx.device_type)
    name, capability = _device_name(ctx)
    precision = pick_precision(requested, ctx.device_type, capability)
    threads = torch.get_num_threads()
    slowed = slowed_rank() == ctx.rank
    fixed = CUDA_REPS if cuda else None
    world = dist.group.WORLD if ctx.is_distributed else None

    def phase(name: str) -> None:
        if world is not None:
            dist.barrier()
        recorder.heartbeat(PHASES.index(name))

    gemm_n = CUDA_GEMM_N if cuda else (CPU_GEMM_N_MANY_THREADS if threads >= 8 else CPU_GEMM_N)
    gemm = _gemm(clock, device, precision, gemm_n, slowed, fixed)
    phase("gemm")
    copy_bytes = CUDA_COPY_BYTES if cuda else CPU_COPY_BYTES_PER_THREAD * threads
    copy = _copy(clock, device, copy_bytes, slowed, fixed)
    phase("copy")
    local, nodes = ctx.local_world_size, max(1, ctx.world_size // max(1, ctx.local_world_size))
    ar_bytes = CUDA_ALLREDUCE_BYTES if cuda else CPU_ALLREDUCE_BYTES
    ar_reps = CUDA_REPS if cuda else CPU_ALLREDUCE_REPS
    node_ar = world_ar = None
    if ctx.is_distributed:
        # torchrun numbers the ranks of a node consecutively: the node's group is its block
        node_group = world if nodes == 1 else dist.new_subgroups(group_size=local)[0]
        if local > 1:
            node_ar = _allreduce(clock, device, ar_bytes, node_group, local, ar_reps)
        phase("allreduce node")
        if nodes > 1:
            world_ar = _allreduce(clock, device, ar_bytes, world, ctx.world_size, ar_reps)
        phase("allreduce world")
    return {"device": ctx.device_type, "device_name": name, "local_rank": ctx.local_rank, "node_rank": ctx.node_rank,
            "host": ctx.host, "local_world_size": local, "world_size": ctx.world_size, "precision": precision,
            "threads": threads, "capability": list(capability) if capability else None, "slowed": slowed,
            "torch": torch.__version__, "gemm": gemm, "copy": copy, "allreduce_node": node_ar,
            "allreduce_world": world_ar}

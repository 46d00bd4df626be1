"""Measure what gloo collectives cost between N ranks sharing this host, once per host and N.

On CPU ranks a collective cannot hide behind compute (gloo moves bytes through the loopback TCP
stack on the cores the ranks compute on), and its latency depends on the ranks being busy: on a
2-core VM (torch 2.13) a 4-KiB all-gather takes ~0.2 ms between two idle ranks, ~1 ms between
ranks that compute between collectives (a sleeping gloo thread must be woken on a busy core), and
~5 ms between four ranks on the two cores (each step waits for a time slice). FSDP units and DDP
buckets pay that per collective, so the probe measures it as training sees it: N threads, each
with its own `ProcessGroupGloo` over loopback (torch releases the GIL inside its kernels and
collectives), run a ~1 ms matmul before every collective, and the mean extra time of an iteration
with a collective over one with the matmul alone is its cost: at a small and a large size for
all-reduce, all-gather and reduce-scatter, giving a time per byte for each and one latency (the
wake-ups and scheduling they share). It takes 0.8-1.5 s; `resolve.cached_gloo_rates` caches it.

Never imports cli, backends, jobs, runtime or report; torch only inside `measure_gloo` (run only when
its cache entry is missing).
"""

from __future__ import annotations

import datetime
import os
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from launcher.hardware.types import rank_threads
from launcher.plan.cpu_rates import COLLECTIVES, GlooRates

# bytes of the two sizes each collective is timed at (fp32 buffers)
SMALL_BYTES = 16 * 1024
LARGE_BYTES = 4 * 1024 * 1024
# collectives per phase at each size, and the matmul (rows, k, n) each rank runs before each one:
# ~0.1 GFLOP, a few ms on one core, about a small model's block
SMALL_REPEATS = 10
LARGE_REPEATS = 6
# every phase runs this often, alternating: two rounds of 4 left the all-reduce's time per byte
# anywhere in 2.3-11e-10 s across five probes on a 2-core VM (workloads/mlp.py's exposed all-reduce
# predicted at 3.5 ms, measured 5.3); four of 6 kept it in 6.5-8.7e-10
ROUNDS = 4
COMPUTE_GEMM = (96, 512, 1024)
# bump when `measure_gloo` measures differently, so old cache entries are ignored
GLOO_PROBE_FORMAT = 3
TIMEOUT_S = 60


def _groups(torch_dist: Any, ranks: int) -> list[Any]:
    """`ranks` gloo groups, one per rank, connected over loopback through an in-process store."""
    store = torch_dist.HashStore()
    groups: list[Any] = [None] * ranks

    def connect(rank: int) -> None:
        opts = torch_dist.ProcessGroupGloo._Options()
        opts._devices = [torch_dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        opts._timeout = datetime.timedelta(seconds=TIMEOUT_S)
        groups[rank] = torch_dist.ProcessGroupGloo(torch_dist.PrefixStore("probe", store), rank, ranks, opts)

    _in_threads(ranks, connect)
    return groups


def _in_threads(ranks: int, body: Callable[[int], None]) -> None:
    """`body(rank)` in a thread per rank; the first error any raised is raised in the caller's thread."""
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            body(rank)
        except BaseException as e:  # noqa: BLE001 - re-raised below in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    if errors:
        raise errors[0]


def measure_gloo(ranks: int) -> GlooRates:
    """Time all-reduce, all-gather and reduce-scatter between `ranks` busy ranks of this host."""
    import torch
    import torch.distributed as dist

    from launcher.hardware.detect import cpu_info

    started = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        groups = _groups(dist, ranks)
        m, k, n = COMPUTE_GEMM
        # (op, size) -> every rank's seconds per iteration (matmul + collective)
        samples: dict[tuple[str, int], list[float]] = {}
        lock = threading.Lock()
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        # each rank computes with the threads it will have: one rank of a 2-core host runs two,
        # and gloo's worker then waits for a core they keep busy
        threads_each = rank_threads(len(cpus), ranks) if cpus else 1

        def rank_body(rank: int) -> None:
            torch.set_num_threads(threads_each)
            if cpus and threads_each == 1:
                # one core per rank, round robin, as the scheduler spreads rank processes
                # (on Linux this pins the calling thread only)
                os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
            pg = groups[rank]
            a, b = torch.randn(m, k), torch.randn(k, n)
            bufs = {size: (torch.ones(size // 4), torch.empty(size // 4), torch.empty(size // 4 // ranks))
                    for size in (SMALL_BYTES, LARGE_BYTES)}
            ops: dict[str, Callable[[int], Any]] = {
                "ar": lambda size: pg.allreduce([bufs[size][0]]).wait(),
                "ag": lambda size: pg._allgather_base(bufs[size][1], bufs[size][0][: size // 4 // ranks]).wait(),
                "rs": lambda size: pg._reduce_scatter_base(bufs[size][2], bufs[size][0]).wait(),
                "none": lambda size: None,
            }
            once = [("none", SMALL_BYTES, SMALL_REPEATS)]
            once += [(op, size, reps) for size, reps in ((SMALL_BYTES, SMALL_REPEATS), (LARGE_BYTES, LARGE_REPEATS))
                     for op in COLLECTIVES]
            plan = once * ROUNDS
            for op, size, _ in plan:  # warm: connections, allocations
                ops[op](size)
            for op, size, reps in plan:
                pg.barrier().wait()
                took = []
                for _ in range(reps):
                    t = time.perf_counter()
                    torch.mm(a, b)
                    ops[op](size)
                    took.append(time.perf_counter() - t)
                with lock:
                    samples.setdefault((op, size), []).extend(took)

        _in_threads(ranks, rank_body)
    finally:
        torch.set_num_threads(threads)
    # means, not medians: a step pays every collective, the late wake-ups too (most take
    # ~0.3 ms between two busy ranks of a 2-core VM, one in six 1.5-7 ms: the mean is ~1 ms)
    mean = {key: statistics.fmean(v) for key, v in samples.items()}
    alone = mean[("none", SMALL_BYTES)]
    # the latency is the wake-ups and scheduling the three share: one figure from all three
    pooled = max(0.0, statistics.fmean([t for op in COLLECTIVES for t in samples[(op, SMALL_BYTES)]]) - alone)
    latency, per_byte = {}, {}
    for op in COLLECTIVES:
        small = max(0.0, mean[(op, SMALL_BYTES)] - alone)
        large = max(small, mean[(op, LARGE_BYTES)] - alone)
        latency[op] = round(pooled, 7)
        per_byte[op] = (large - small) / (LARGE_BYTES - SMALL_BYTES)
    return GlooRates(ranks=ranks, latency_s=latency, s_per_byte=per_byte, cores=cpu_info().usable_cores,
                     measured_at=datetime.datetime.now().isoformat(timespec="seconds"),
                     source=f"gloo probe: {ranks} busy ranks in threads over loopback, torch "
                            f"{torch.__version__} ({time.perf_counter() - started:.2f} s)")


__all__ = ["measure_gloo", "GLOO_PROBE_FORMAT", "SMALL_BYTES", "LARGE_BYTES"]

"""The data a rank trains on: its DataLoader over exactly its samples, in a fixed order, and
each step's micro-batches fetched onto the device with the time the step waited for them
(`data_wait_s`: the loader's time, not the copy's).

Never imports cli, backends, jobs or report; torch at module level (see runtime/__init__).
"""

from __future__ import annotations

import multiprocessing.util
import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from launcher.errors import LaunchError, WorkloadError
from launcher.runspec import LaunchSpec
from launcher.runtime.context import RankContext
from launcher.runtime.resume import SkipSampler
from launcher.runtime.stream import RankStream
from launcher.runtime.window import Clock
from launcher.runtime.wrap import dp_rank
from launcher.workload import Workload

# a map-style dataset's sampler holds a Python list of every index (~36 bytes each: the int and
# its slot); past 2^26 samples that is over 2 GiB per rank, so such a run fails at once, saying
# why, instead of running the host out of memory
MAX_INDEXED_SAMPLES = 2**26
_INDEX_BYTES = 36
# Linux's sockaddr_un.sun_path: 108 bytes with the terminating NUL
_SUN_PATH_MAX = 108
# the name multiprocessing gives a listener inside its pymp-* directory ("listener-" + 8 chars)
_LISTENER_NAME = "listener-xxxxxxxx"


def worker_socket_problem(pymp_dir: str) -> str | None:
    """Why DataLoader workers would hang under `pymp_dir` (multiprocessing's temporary directory),
    or None: a worker hands each batch to its rank over a Unix socket there, and a path past
    sun_path's limit fails inside its queue thread, which drops the batch; the rank waits forever."""
    path = os.path.join(pymp_dir, _LISTENER_NAME)
    if not sys.platform.startswith("linux") or len(os.fsencode(path)) < _SUN_PATH_MAX:
        return None
    return (f"TMPDIR is too long for DataLoader workers: they pass batches over Unix sockets under "
            f"{pymp_dir} ({len(os.fsencode(path))} bytes with the socket's name, the limit is "
            f"{_SUN_PATH_MAX - 1}), so the first batch would never arrive; set TMPDIR to a shorter "
            "directory (e.g. TMPDIR=/tmp), or run with --num-workers 0")


def check_worker_sockets(workers: int) -> None:
    """LaunchError where this process's DataLoader workers would hang on their sockets; only the
    file-descriptor sharing strategy (Linux's default) passes batches over sockets."""
    if workers == 0 or torch.multiprocessing.get_sharing_strategy() != "file_descriptor":
        return
    problem = worker_socket_problem(multiprocessing.util.get_temp_dir())
    if problem:
        raise LaunchError(problem)


def make_loader(workload: Workload, spec: LaunchSpec, ctx: RankContext, *, start_step: int = 0) -> DataLoader[Any]:
    """A DataLoader over exactly the samples this rank trains on, in a fixed order: data-parallel
    rank d (`wrap.dp_rank`) gets every dp_size-th index, so the dp ranks' micro-batches at a step
    make one process's batch; after a resume at `start_step`, from step start_step + 1 on."""
    dataset = workload.make_dataset(spec.steps * spec.global_batch)
    dp_size, rank = ctx.world_size // spec.tp, dp_rank(ctx.rank, spec.tp)
    workers = spec.loader.num_workers
    check_worker_sockets(workers)
    kwargs: dict[str, Any] = {
        "batch_size": spec.micro_batch, "drop_last": True, "num_workers": workers,
        "pin_memory": spec.loader.pin_memory and ctx.device_type == "cuda",
        "persistent_workers": spec.loader.persistent_workers and workers > 0,
        "prefetch_factor": spec.loader.prefetch_factor if workers > 0 else None}
    if isinstance(dataset, IterableDataset):  # split and resumed as a stream (runtime.stream)
        stream = RankStream(dataset, dp_size=dp_size, dp_rank=rank, micro_batch=spec.micro_batch,
                            skip_batches=start_step * spec.grad_accum)
        return DataLoader(stream, **kwargs)
    samples = len(dataset)  # type: ignore[arg-type]  # a map-style dataset is Sized
    if samples > MAX_INDEXED_SAMPLES:
        raise WorkloadError(
            f"the dataset holds {samples:,} samples (--steps {spec.steps:,} x global batch "
            f"{spec.global_batch:,}), and DistributedSampler lists every index in each rank's memory "
            f"(~{_INDEX_BYTES * samples / 2**30:,.0f} GiB); run fewer --steps, or let the workload's "
            "make_dataset return an IterableDataset (streamed, never listed)")
    ranks: DistributedSampler[int] = DistributedSampler(dataset, num_replicas=dp_size, rank=rank,
                                                        shuffle=spec.loader.shuffle, seed=spec.seed, drop_last=True)
    sampler: Iterable[int] = ranks
    if start_step:
        sampler = SkipSampler(ranks, start_step * spec.micro_batch * spec.grad_accum)
    return DataLoader(dataset, sampler=sampler, generator=torch.Generator().manual_seed(spec.seed), **kwargs)


def to_device(batch: object, device: torch.device) -> object:
    """Move a batch (tensor, or tuple / list / dict of them) to `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, tuple | list):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def fetch(batches: Iterator[Any], accum: int, device: torch.device, clock: Clock) -> tuple[list[Any], float]:
    """One step's micro-batches on the device, and the step's data wait: the part of the host's
    time in the loader alone (not the copy's) the step waited for (`Clock.exposed_wait`)."""
    fetch_start = time.perf_counter()
    try:
        fetched = [next(batches) for _ in range(accum)]
    except StopIteration:  # bare, it would name nothing
        raise WorkloadError("the workload's data ran dry: its dataset or stream ended before the run's last "
                            "step; give it more samples (or repeat the stream), or run fewer --steps") from None
    data_wait = clock.exposed_wait(time.perf_counter() - fetch_start)
    return [to_device(b, device) for b in fetched], data_wait

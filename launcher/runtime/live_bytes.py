"""Peak live tensor bytes on CPU, the ground truth the memory model is checked against.

CPU has no allocator statistics (CUDA has `max_memory_allocated`), so `LiveBytes` reads the CPU
allocator's own record: with `profile_memory=True` torch's profiler logs every allocation and
free of c10's CPU allocator (`[memory]` events, bytes signed, in time order), and the peak is
the largest running sum over the tracked span on top of the bytes already live when it began
(`add_existing`: parameters, buffers, gradients, optimizer state). It sees what a
`TorchDispatchMode` cannot: FSDP2's all-gather buffers and unsharded parameters (resized
storages, never an op), DTensor's local shards, buffers torch.compile's generated code
allocates directly, and an op's scratch: the bytes `max_memory_allocated` counts on CUDA. The
allocator reports to the profiler of its own thread: on CPU forward, backward, the optimizer
and compiled code all run on the rank's main thread; gloo's transport buffers are not counted.
While it runs, stderr is held and given back when it ends, less torch's notes about the span.

`StepSampler` runs it for one training step of a rank on CPU, the last warm-up step: the
optimizer state exists by then, and a warm-up step is out of every measured number (the
profiler slows it down a little). It samples every strategy, compiled or not; not when the
run's own profiler (`--profile`) is recording, since torch's profiler does not nest.

Imports torch at module level, as every module behind the rank's door does (see
runtime/__init__); the CLI and the planner never import it (benchmarks do, for the memory check).
Never imports any other part of dlaunch.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import tempfile
from collections.abc import Iterable
from types import TracebackType
from typing import Any

import torch

log = logging.getLogger(__name__)

MEMORY_EVENT = "[memory]"  # the profiler's name for an allocator event (torch.autograd.profiler_util)
# what torch prints on stderr about the span itself, dropped (see _QuietStderr): c10's CPU
# allocator (CPUAllocator.cpp, at most once a second) whenever a storage made before the span is
# freed inside it, which is expected here; Kineto's start and stop lines
PROFILER_NOTES = (b"Memory block of unknown size was allocated before the profiling started",
                  b"SyncActivityProfilerHandler.cpp")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor that owns `t`'s bytes on this rank: a DTensor's local shard, else `t`."""
    local = getattr(t, "_local_tensor", None)  # DTensor (FSDP2's sharded parameters)
    return local if isinstance(local, torch.Tensor) else t


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct CPU storages behind `tensors` (views and shared storages once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        t = local_tensor(t)
        if t.device.type != "cpu":
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


def running_peak(events: Iterable[tuple[int, int]]) -> int:
    """The largest running sum of signed byte counts in time order, from (time, bytes) pairs."""
    live = peak = 0
    for _, nbytes in sorted(events, key=lambda e: e[0]):
        live += nbytes
        peak = max(peak, live)
    return peak


class _QuietStderr:
    """Holds file descriptor 2 in a temporary file while active, then writes it back to stderr
    without the PROFILER_NOTES lines (a process killed by a signal meanwhile loses that output)."""

    def __init__(self) -> None:
        self._saved = -1
        self._file: Any = None

    def __enter__(self) -> None:
        sys.stderr.flush()
        self._file = tempfile.TemporaryFile()
        self._saved = os.dup(2)
        os.dup2(self._file.fileno(), 2)

    def __exit__(self, *exc: object) -> None:
        if self._file is None:
            return
        sys.stderr.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._file.seek(0)
        kept = [line for line in self._file.read().splitlines(keepends=True)
                if not any(note in line for note in PROFILER_NOTES)]
        self._file.close()
        self._file = None
        if kept:
            os.write(2, b"".join(kept))


class LiveBytes:
    """Peak bytes of CPU tensor storages over a span: those that existed before it
    (`add_existing`) plus the largest running sum of the allocations and frees made inside it;
    set when the context exits."""

    def __init__(self) -> None:
        self.existing = self.peak = 0
        self._profiler: Any = None
        self._quiet = _QuietStderr()

    def add_existing(self, tensors: Iterable[torch.Tensor | None]) -> None:
        """Count tensors made before the span began (parameters, optimizer state)."""
        self.existing += storage_bytes(tensors)
        self.peak = max(self.peak, self.existing)

    def __enter__(self) -> LiveBytes:
        # c10's CPU allocator reports a free only for a block it saw allocated while profiling:
        # a storage made before the span (the previous step's batch) is neither counted nor
        # uncounted; those that persist are `existing`
        self._quiet.__enter__()
        self._profiler = torch.autograd.profiler.profile(use_kineto=True, profile_memory=True)
        self._profiler.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        prof, self._profiler = self._profiler, None
        if prof is None:
            return
        try:
            prof.__exit__(exc_type, exc, tb)
        finally:
            self._quiet.__exit__()
        if exc_type is None:
            events = ((e.start_ns(), e.nbytes()) for e in prof.kineto_results.events()
                      if e.name() == MEMORY_EVENT and str(e.device_type()) == "DeviceType.CPU")
            self.peak = max(self.peak, self.existing + running_peak(events))


# the fewest warm-up steps for a representative sample: step 1 creates the optimizer state
SAMPLE_MIN_WARMUP = 2


class StepSampler:
    """Peak live tensor bytes of one step: `begin(step)` before it, `end(step, record)` after,
    which puts it in the step's record as `live_peak_bytes`. Counts the module's parameters,
    buffers, gradients and optimizer state at the start, then every storage the step allocates."""

    def __init__(self, *, step: int | None, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.step = step  # None: samples nothing
        self._module, self._optimizer = module, optimizer
        self._tracker: LiveBytes | None = None

    @classmethod
    def for_rank(cls, *, device_type: str, start: int, warmup_steps: int, steps: int,
                 module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> StepSampler:
        """The sampler of a rank: none on CUDA (allocator statistics), nor under SAMPLE_MIN_WARMUP."""
        step: int | None = start + warmup_steps
        if device_type != "cpu" or warmup_steps < SAMPLE_MIN_WARMUP or start + warmup_steps > steps:
            step = None
        return cls(step=step, module=module, optimizer=optimizer)

    def begin(self, step: int) -> None:
        """Start tracking when `step` is the sampled one (and no profiler is recording)."""
        if step != self.step:
            return
        if torch.autograd.profiler._is_profiler_enabled:
            # torch's profiler does not nest; the run's own (--profile) records this step
            log.debug("live bytes: a profiler is already recording; step %d not sampled", step)
            return
        tracker = LiveBytes()
        # zero1's optimizer keeps its state in its local optimizer (`optim`)
        held = getattr(self._optimizer, "optim", self._optimizer)
        state = (v for s in held.state.values() for v in s.values())
        tracker.add_existing(itertools.chain(self._module.parameters(), self._module.buffers(),
                                             (p.grad for p in self._module.parameters()), state))
        tracker.__enter__()
        self._tracker = tracker

    def end(self, step: int, record: dict[str, Any]) -> None:
        """Stop tracking after the sampled step and add its peak to the step's record."""
        if (tracker := self._tracker) is None or step != self.step:
            return
        self._tracker = None
        tracker.__exit__(None, None, None)
        # keep "warmup" right before the "step_time_s" the window appends: the report reads
        # step times with one regular expression over that layout (report.runs)
        warmup = record.pop("warmup", None)
        record["live_peak_bytes"] = tracker.peak
        if warmup is not None:
            record["warmup"] = warmup

    def abort(self) -> None:
        """Stop tracking without a measurement (the step failed); idempotent."""
        tracker, self._tracker = self._tracker, None
        if tracker is not None:
            tracker.__exit__(RuntimeError, RuntimeError("step failed"), None)

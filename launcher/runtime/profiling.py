"""Diagnostics a rank can run on request: the step profiler (`--profile`), the CUDA memory
snapshot (`--memory-snapshot`) and anomaly mode (`--detect-anomaly`).

The profiler skips the warm-up steps (compilation, allocator growth and DataLoader start-up
would dominate otherwise), then takes one profiler warm-up step and up to three recorded steps.
It writes a Chrome / Perfetto trace per rank (`trace-rank<r>.json`, open it at
https://ui.perfetto.dev) and a `profile` record with the top operators by self time. Nothing
here synchronises the host with the device per step; `prof.step()` only advances the schedule.

The memory snapshot records Python stacks only (`stacks="python"`): with C++ frames too, the
dump at the end took torchtitan 461 s against 4 s, long enough for the hang watcher to end the
job. The dump runs inside `recorder.busy`, whose thread beats the heartbeat while it lasts.

Never imports cli, backends, jobs or report; torch at module level (see runtime/__init__).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.profiler as tp
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEventAvg

from launcher.rundir import RunPaths

log = logging.getLogger(__name__)

ACTIVE_STEPS = 3
TOP_OPS = 10
SNAPSHOT_ENTRIES = 100_000  # allocation events kept by the CUDA memory history
# the device types whose rows are a device's own work (kernels, memcpy, memset): the ones
# torch's `key_averages().table()` sums for its "Self CUDA time total"
DEVICE_WORK = ("CUDA", "PrivateUse1", "MTIA", "XPU")


def device_time_us(averages: Sequence[FunctionEventAvg]) -> float:
    """The device's busy time in `prof.key_averages()`: its kernel rows, as torch's table sums them
    (not the CPU ops' self device time, nor `record_function` ranges, flagged `is_user_annotation`;
    a legacy-profiler CPU row carries its kernel's time). Overlapping streams each count in full."""
    kinds = tuple(getattr(DeviceType, name) for name in DEVICE_WORK)
    return float(sum(evt.self_device_time_total for evt in averages
                     if (getattr(evt, "is_legacy", False) if evt.device_type == DeviceType.CPU
                         else evt.device_type in kinds and not getattr(evt, "is_user_annotation", False))))


# CPU-side rows that are not operators: CUPTI's mark for a launch that waited because the
# device's command queue was full (seen as the top "op" of a compiled gpt step on an H100, its
# kernels attributed to it). Its kernels stay in the device total; it is not listed as an op.
NOT_OPS = frozenset({"Command Buffer Full"})


def top_ops(averages: Sequence[FunctionEventAvg], *, cuda: bool, steps: int,
            limit: int = TOP_OPS) -> list[dict[str, Any]]:
    """The operators with the most self time, from `prof.key_averages()`: on CUDA by self device
    time over the CPU-side rows, as shares of `device_time_us` (device rows would count each
    kernel twice); on CPU by self CPU time. `ProfilerStep#N` and `NOT_OPS` are left out."""
    rows = []
    for evt in averages:
        # a key of None is typed, never seen (the rows are grouped by key)
        if (evt.key is None or evt.key.startswith("ProfilerStep") or evt.key in NOT_OPS
                or (cuda and evt.device_type != DeviceType.CPU)):
            continue
        self_us = evt.self_device_time_total if cuda else evt.self_cpu_time_total
        if self_us > 0:
            rows.append((self_us, evt))
    listed = sum(us for us, _ in rows)
    # the ops' kernels are part of the device total; max() only guards odd tables (shares <= 1)
    total = (max(device_time_us(averages), listed) if cuda else listed) or 1.0
    rows.sort(key=lambda r: r[0], reverse=True)
    return [{"name": evt.key, "self_s": us / 1e6, "per_step_ms": us / 1e3 / max(1, steps),
             "share": us / total, "calls": int(evt.count),
             "calls_per_step": evt.count / max(1, steps)} for us, evt in rows[:limit]]


def profile_summary(averages: Sequence[FunctionEventAvg], *, cuda: bool, steps: int) -> dict[str, Any]:
    """The `profile` record's numbers from `prof.key_averages()` over `steps` recorded steps:
    `top_ops`, and on CUDA `device_time_s`, the kernels' time over the window (aggregate
    divides it by the profiled steps' time: "GPU busy", the launch-bound verdict)."""
    out: dict[str, Any] = {"top_ops": top_ops(averages, cuda=cuda, steps=steps)}
    if cuda:
        out["device_time_s"] = device_time_us(averages) / 1e6
    return out


class StepProfiler:
    """torch.profiler over the steps after warm-up; call `step()` after every training step."""

    def __init__(self, *, run_dir: str | Path, rank: int, warmup_steps: int, steps: int, cuda: bool) -> None:
        self.rank, self.cuda, self.warmup_steps = rank, cuda, warmup_steps
        self.path = RunPaths(root=run_dir).trace(rank)
        # the recorded steps must fit in the run (LaunchSpec checks steps >= warm-up + 2)
        self.active = max(1, min(ACTIVE_STEPS, steps - warmup_steps - 1))
        activities = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if cuda else [])
        self.record: dict[str, Any] = {"kind": "profile", "trace": None, "top_ops": [], "profiled_steps": [],
                                       "by": "self device time" if cuda else "self CPU time"}
        self._prof = tp.profile(activities=activities, on_trace_ready=self._ready,
                                schedule=tp.schedule(wait=warmup_steps, warmup=1, active=self.active, repeat=1))
        self._prof.__enter__()
        self._closed = False

    def profiled(self, step: int) -> bool:
        """Whether 1-based training step `step` falls in the recorded window."""
        first = self.warmup_steps + 2
        return first <= step < first + self.active

    def step(self) -> None:
        """Advance the schedule (cheap: no device sync)."""
        self._prof.step()

    def _ready(self, prof: tp.profile) -> None:
        # called once, when the recorded window closes: export, then summarise
        prof.export_chrome_trace(str(self.path))
        self.record["trace"] = str(self.path)
        self.record.update(profile_summary(prof.key_averages(), cuda=self.cuda, steps=self.active))
        self.record["profiled_steps"] = [self.warmup_steps + 2 + i for i in range(self.active)]

    def close(self) -> dict[str, Any]:
        """Stop profiling (exports if the window just closed) and return the `profile` record."""
        if not self._closed:
            self._closed = True
            self._prof.__exit__(None, None, None)
        if self.record["trace"] is None:
            log.warning("rank %d: the profiler window did not complete; no trace written", self.rank)
        return self.record


def start_memory_history() -> None:
    """Record every CUDA allocation and free with its Python stack (not C++'s: see above)."""
    torch.cuda.memory._record_memory_history(enabled="all", stacks="python", max_entries=SNAPSHOT_ENTRIES)


def dump_memory_snapshot(run_dir: str | Path, rank: int, *, reason: str,
                         busy: contextlib.AbstractContextManager[Any] | None = None) -> dict[str, Any]:
    """Write the allocation history to `memory-rank<r>.pickle` (it opens at
    https://pytorch.org/memory_viz) inside `busy` (the recorder's); returns the record for it."""

    path = RunPaths(root=run_dir).memory_snapshot(rank)
    try:
        with busy or contextlib.nullcontext():
            torch.cuda.memory._dump_snapshot(str(path))
    except Exception as e:  # a failing dump must not hide the error that led here (an OOM)
        print(f"rank {rank}: cannot write the memory snapshot: {e}", file=sys.stderr)
        return {"kind": "memory_snapshot", "path": None, "reason": reason, "error": str(e)}
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return {"kind": "memory_snapshot", "path": str(path), "reason": reason}


def enable_anomaly_detection(rank: int, *, dtensors: bool = False) -> None:
    """Anomaly mode: backward names the forward op whose gradient became NaN (slow). Its NaN check calls
    aten._is_any_true, which DTensor cannot shard: under TP (`dtensors`) on the replicated gradient."""
    if dtensors:
        from torch.distributed.tensor import Replicate, experimental
        experimental.register_sharding(torch.ops.aten._is_any_true.default)(lambda x: [([Replicate()], [Replicate()])])
    torch.autograd.set_detect_anomaly(True, check_nan=True)
    if rank == 0:
        print("dlaunch: anomaly detection on: steps are slower; a NaN in backward raises with "
              "the forward op that made it", file=sys.stderr, flush=True)

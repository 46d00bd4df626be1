"""Diagnostics a rank can run on request: the step profiler (`--profile`), the CUDA memory
snapshot (`--memory-snapshot`) and anomaly mode (`--detect-anomaly`).

The profiler follows a schedule that skips the warm-up steps (compilation, allocator growth and
DataLoader start-up would dominate otherwise): wait = warm-up steps, one profiler warm-up step,
then up to three recorded steps. It writes a Chrome / Perfetto trace per rank
(`trace-rank<r>.json`, open it at https://ui.perfetto.dev) and a `profile` record with the top
operators by self time: device time on CUDA, CPU time on CPU. Nothing here synchronises the
host with the device per step; `prof.step()` only advances the schedule.

Never imports cli, backends, jobs or report; torch only inside functions (see
runtime/__init__).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from launcher.rundir import RunPaths

log = logging.getLogger(__name__)

ACTIVE_STEPS = 3
TOP_OPS = 10
SNAPSHOT_ENTRIES = 100_000  # allocation events kept by the CUDA memory history


def top_ops(averages: Any, *, cuda: bool, steps: int, limit: int = TOP_OPS) -> list[dict[str, Any]]:
    """The operators with the most self time, from `prof.key_averages()`.

    On CUDA the ranking is by self device time (what the GPU spent in the op's kernels), on
    CPU by self CPU time. `ProfilerStep#N` entries are the schedule's own markers: left out.
    """
    rows = []
    for evt in averages:
        if evt.key.startswith("ProfilerStep"):
            continue
        self_us = evt.self_device_time_total if cuda else evt.self_cpu_time_total
        if self_us > 0:
            rows.append((self_us, evt))
    total = sum(us for us, _ in rows) or 1.0
    rows.sort(key=lambda r: r[0], reverse=True)
    return [{"name": evt.key, "self_s": us / 1e6, "per_step_ms": us / 1e3 / max(1, steps),
             "share": us / total, "calls": int(evt.count),
             "calls_per_step": evt.count / max(1, steps)} for us, evt in rows[:limit]]


class StepProfiler:
    """torch.profiler over the steps after warm-up; call `step()` after every training step."""

    def __init__(self, *, run_dir: str | Path, rank: int, warmup_steps: int, steps: int,
                 cuda: bool) -> None:
        # deferred: torch loads only once the rank's recorder runs (see runtime/__init__)
        import torch.profiler as tp

        self.rank = rank
        self.cuda = cuda
        self.path = RunPaths(root=run_dir).trace(rank)
        self.warmup_steps = warmup_steps
        # the recorded steps must fit in the run (LaunchSpec checks steps >= warm-up + 2)
        self.active = max(1, min(ACTIVE_STEPS, steps - warmup_steps - 1))
        activities = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if cuda else [])
        self.record: dict[str, Any] = {"kind": "profile", "trace": None, "top_ops": [],
                                       "profiled_steps": [], "by": "self device time" if cuda
                                       else "self CPU time"}
        self._prof = tp.profile(
            activities=activities,
            schedule=tp.schedule(wait=warmup_steps, warmup=1, active=self.active, repeat=1),
            on_trace_ready=self._ready)
        self._prof.__enter__()
        self._closed = False

    def profiled(self, step: int) -> bool:
        """Whether 1-based training step `step` falls in the recorded window."""
        first = self.warmup_steps + 2
        return first <= step < first + self.active

    def step(self) -> None:
        """Advance the schedule (cheap: no device sync)."""
        self._prof.step()

    def _ready(self, prof: Any) -> None:
        # called once, when the recorded window closes: export, then summarise
        prof.export_chrome_trace(str(self.path))
        averages = prof.key_averages()
        self.record["trace"] = str(self.path)
        self.record["top_ops"] = top_ops(averages, cuda=self.cuda, steps=self.active)
        self.record["profiled_steps"] = [self.warmup_steps + 2 + i for i in range(self.active)]
        if self.cuda:
            # kernel time over the window; aggregate divides by the profiled steps' time
            self.record["device_time_s"] = sum(e.self_device_time_total for e in averages
                                               if not e.key.startswith("ProfilerStep")) / 1e6

    def close(self) -> dict[str, Any]:
        """Stop profiling (exports if the window just closed) and return the `profile` record."""
        if not self._closed:
            self._closed = True
            self._prof.__exit__(None, None, None)
        if self.record["trace"] is None:
            log.warning("rank %d: the profiler window did not complete; no trace written", self.rank)
        return self.record


def start_memory_history() -> None:
    """Record CUDA allocations with stacks (torch.cuda.memory._record_memory_history)."""
    # deferred: torch loads only once the rank's recorder runs (see runtime/__init__)
    import torch

    torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_ENTRIES)


def dump_memory_snapshot(run_dir: str | Path, rank: int, *, reason: str) -> dict[str, Any]:
    """Write the allocation history to `memory-rank<r>.pickle`; returns the record for it.

    The pickle opens at https://pytorch.org/memory_viz.
    """
    # deferred: torch loads only once the rank's recorder runs (see runtime/__init__)
    import torch

    path = RunPaths(root=run_dir).memory_snapshot(rank)
    try:
        torch.cuda.memory._dump_snapshot(str(path))
    except Exception as e:  # a failing dump must not hide the error that led here (an OOM)
        print(f"rank {rank}: cannot write the memory snapshot: {e}", file=sys.stderr)
        return {"kind": "memory_snapshot", "path": None, "reason": reason, "error": str(e)}
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return {"kind": "memory_snapshot", "path": str(path), "reason": reason}


def enable_anomaly_detection(rank: int) -> None:
    """Anomaly mode: backward names the forward op whose gradient became NaN (slow)."""
    # deferred: torch loads only once the rank's recorder runs (see runtime/__init__)
    import torch

    torch.autograd.set_detect_anomaly(True, check_nan=True)
    if rank == 0:
        print("dlaunch: anomaly detection on: steps are slower; a NaN in backward raises with "
              "the forward op that made it", file=sys.stderr, flush=True)

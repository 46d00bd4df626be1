"""Logging windows: the harness's per-step measurements, resolved and written a window at a time.

Measurement never syncs the host with the device per step: on CUDA each step is bracketed by
events that are read at the end of a window; losses (and the fp16 loss scale) stay tensors
until then. On CPU the step is synchronous anyway, so `perf_counter` is exact.

Two measurements are made so that on CUDA they mean what they mean on CPU, without a sync:
- data wait (`Clock.exposed_wait`): on CPU the host's time in the loader is the step's wait; on
  CUDA a fetch the device hid (the previous step's end event had not completed when it ended)
  counts 0, and one after the device drained counts whole: an upper bound.
- peak memory (`peak_mem_bytes`): on CUDA the allocator's peak is reset at the attempt's first
  steady step (`Window.begin`), so compile autotuning and warm-up are not counted; it counts
  tensors (`max_memory_allocated`), as the plan's tensor part it is compared with does.

Closing a window is a collective (one all-reduce averages the losses and carries each rank's stop
flag), so every rank must close at the same step: its length comes from the previous window's
rank-averaged step time (`window_steps`), plus steps all ranks know (the last, a checkpoint's).

Never imports cli, backends, jobs or report; torch at module level (see runtime/__init__).
"""

from __future__ import annotations

import logging
import math
import resource
import sys
import time
from typing import Any, TypeAlias, cast

import torch
import torch.distributed as dist

from launcher.runtime.context import RankContext
from launcher.runtime.recorder import RankRecorder

log = logging.getLogger(__name__)

# flush about this often even when --log-every steps take longer, so a killed rank loses little
# and a preemption request waits at most this long (plus one step) for the window's end
FLUSH_INTERVAL_S = 5.0
# without --log-every: DEFAULT_WINDOW_STEPS steps, or as many as take MIN_WINDOW_S. Closing a
# window costs an all-reduce and a file write (~2.6 ms with gloo on 2 CPU ranks): 2.5% of a
# 10 ms step when paid every 10 steps, 0.5% every 0.5 s
DEFAULT_WINDOW_STEPS = 10
MIN_WINDOW_S = 0.5

# a clock's marks: where a step started (perf_counter seconds, or a CUDA event recorded then),
# and how long it took (seconds, or the event pair that `Clock.resolve` reads)
Mark: TypeAlias = float | torch.cuda.Event
EventPair: TypeAlias = tuple[torch.cuda.Event, torch.cuda.Event]
Span: TypeAlias = float | EventPair


def window_steps(mean_step_s: float, log_every: int | None) -> int:
    """Steps in the next logging window: --log-every (None: DEFAULT_WINDOW_STEPS, more when those
    take under MIN_WINDOW_S), fewer when that would exceed the flush interval. `mean_step_s`: the
    previous window's rank-averaged step time, the same on every rank (see the module docstring)."""
    steps = log_every or 0
    if not log_every:
        steps = DEFAULT_WINDOW_STEPS
        if mean_step_s > 0:
            steps = max(steps, math.ceil(MIN_WINDOW_S / mean_step_s))
    if mean_step_s <= 0:
        return steps
    return max(1, min(steps, int(FLUSH_INTERVAL_S / mean_step_s)))


class Clock:
    """Step timing: CUDA events read lazily, or perf_counter on CPU."""

    def __init__(self, device_type: str) -> None:
        self.cuda = device_type == "cuda"
        self._synced_at = 0.0  # host wall clock right after the last `resolve`'s device sync
        self._last_end: torch.cuda.Event | None = None  # CUDA: the last `stop`'s (a step's end)

    def start(self) -> Mark:
        """A mark at the start of a step."""
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, start: Mark) -> Span:
        """The step's duration: seconds on CPU, an event pair on CUDA (read in `resolve`)."""
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._last_end = ev
            return (cast(torch.cuda.Event, start), ev)
        return time.perf_counter() - cast(float, start)

    def exposed_wait(self, fetch_s: float) -> float:
        """The data wait of a fetch that took the host `fetch_s`, just ended (no sync). On CUDA,
        if the previous step's end event (the last `stop`) has not completed, nothing waited."""
        busy = None
        if self.cuda and self._last_end is not None:
            busy = not self._last_end.query()
        return exposed_wait(fetch_s, device_busy=busy)

    def resolve(self, marks: list[Span]) -> list[float]:
        """Seconds per step; on CUDA this is the one host sync of the window."""
        if not self.cuda:
            return list(cast("list[float]", marks))
        torch.cuda.synchronize()
        self._synced_at = time.time()
        return [a.elapsed_time(b) / 1000.0 for a, b in cast("list[EventPair]", marks)]

    def end_times(self, marks: list[Span], host_ends: list[float]) -> list[float]:
        """Wall-clock end of each step (call after `resolve`): `host_ends` on CPU; on CUDA the
        window's last end event completed when `resolve`'s sync returned, each earlier one the
        events' elapsed time before that, never before the host recorded it."""
        if not self.cuda or not marks:
            return list(host_ends)
        pairs = cast("list[EventPair]", marks)
        last = pairs[-1][1]
        return [max(host, self._synced_at - end.elapsed_time(last) / 1000.0)
                for (_, end), host in zip(pairs, host_ends)]


def exposed_wait(fetch_s: float, *, device_busy: bool | None) -> float:
    """What of a host fetch of `fetch_s` the step waited for: 0 when the device was still running
    the previous step as the fetch ended (`device_busy`; None: CPU or the attempt's first step),
    else the whole fetch (an upper bound)."""
    return 0.0 if device_busy else max(0.0, fetch_s)


def peak_reset_step(start: int, warmup_steps: int) -> int:
    """The step before which the device's peak memory is reset: the attempt's first steady step."""
    return start + warmup_steps + 1


def peak_mem_bytes(device_type: str) -> int:
    """Peak tensor bytes since `Window.begin` reset them (CUDA), or this process's peak RSS (CPU)."""
    if device_type == "cuda":
        return int(torch.cuda.max_memory_allocated())
    # CPU: peak resident set of this process (ru_maxrss is KiB on Linux)
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class Window:
    """The open logging window: step records waiting for their times, losses and skip flags."""

    def __init__(self, clock: Clock, ctx: RankContext, recorder: RankRecorder,
                 scaler: torch.amp.GradScaler, device: torch.device, log_every: int | None, *,
                 steady_from: int = 1) -> None:
        self.clock, self.ctx, self.recorder, self.scaler = clock, ctx, recorder, scaler
        self.log_every = log_every
        self.steady_from = steady_from  # the first steady step (`peak_reset_step`)
        self.length = 1  # the first window is the first step alone: it measures the step time
        self.records: list[dict[str, Any]] = []
        self._marks: list[Span] = []
        self._fwd_bwd_marks: list[Span | None] = []
        self._losses: list[torch.Tensor] = []
        self._fwd_bwd_s: dict[bool, list[float]] = {True: [], False: []}  # by steadiness
        self._scales: list[torch.Tensor] = []
        # the scale tensor is created lazily by the first scale(); start from the initial value
        self._prev_scale = [torch.tensor(scaler.get_scale(), device=device)] if scaler.is_enabled() else []

    def begin(self, step: int) -> None:
        """Before step `step`: at the first steady step, reset the device's peak memory (CUDA; a
        CPU's resident-set peak cannot be reset, and its tensor peak is sampled: live_bytes)."""
        if step == self.steady_from and self.ctx.device_type == "cuda":
            torch.cuda.reset_peak_memory_stats()

    def add(self, record: dict[str, Any], mark: Span, loss: torch.Tensor, fwd_bwd_mark: Span | None = None) -> None:
        """One finished step: its record, its clock mark and its loss tensor (no sync);
        `fwd_bwd_mark`: the mark of its forward and backward alone (for `fwd_bwd_times`)."""
        self.records.append(record)
        self._marks.append(mark)
        self._fwd_bwd_marks.append(fwd_bwd_mark)
        self._losses.append(loss)
        if self.scaler.is_enabled():
            # the scale drops exactly when the step was skipped for inf/NaN gradients;
            # keep a device copy and compare at the window's end (no sync here); the step's
            # scaler.scale() made the scale tensor
            scale = self.scaler._scale
            assert scale is not None
            self._scales.append(scale.detach().clone())

    def fwd_bwd_times(self) -> list[float]:
        """Forward+backward seconds of the closed windows' steady steps, or of all when none was."""
        return self._fwd_bwd_s[True] or self._fwd_bwd_s[False]

    @property
    def full(self) -> bool:
        """The window has its planned number of steps (the same on every rank)."""
        return len(self.records) >= self.length

    def close(self, *, stop: bool = False) -> bool:
        """Resolve timings, losses and skipped steps (one sync, one all-reduce), record them; True
        when any rank was asked to `stop` (in the loss all-reduce, a sum > 0 acts as a MAX)."""
        fb_at = [i for i, m in enumerate(self._fwd_bwd_marks) if m is not None]
        # one resolve (on CUDA the window's one host sync) for the steps and their fwd+bwd parts
        resolved = self.clock.resolve(self._marks + [cast(Span, self._fwd_bwd_marks[i]) for i in fb_at])
        times = resolved[:len(self._marks)]
        for i, fb_s in zip(fb_at, resolved[len(self._marks):]):
            rec = self.records[i]
            self._fwd_bwd_s[not rec.get("warmup") and not rec.get("profiled")].append(fb_s)
        if self._scales:
            values = torch.stack(self._prev_scale + self._scales).float().tolist()
            for rec, before, after in zip(self.records, values, values[1:]):
                rec["skipped"] = after < before
        tail = torch.tensor([sum(times) / len(times), float(stop)], device=self._losses[0].device)
        vec = torch.cat([torch.stack(self._losses).float(), tail])
        if self.ctx.is_distributed:
            dist.all_reduce(vec, op=dist.ReduceOp.SUM)
            vec /= self.ctx.world_size
        *losses, mean_step_s, stop_any = vec.tolist()
        if all("end_time" in rec for rec in self.records):
            ends = self.clock.end_times(self._marks, [rec["end_time"] for rec in self.records])
            for rec, end in zip(self.records, ends):
                rec["end_time"] = end
        self._write(times, losses)
        sys.stdout.flush()
        self.length = window_steps(mean_step_s, self.log_every)
        self._prev_scale = self._scales[-1:] or self._prev_scale
        self.records, self._marks, self._fwd_bwd_marks, self._losses, self._scales = [], [], [], [], []
        return stop_any > 0

    def _write(self, times: list[float], losses: list[float], **scope: str) -> None:
        """Complete and record the steps no `close` has written yet (those without a loss)."""
        peak = peak_mem_bytes(self.ctx.device_type)
        now = time.time()
        for rec, step_time, loss in zip(self.records, times, losses):
            if "loss" not in rec:
                rec.update(step_time_s=step_time, loss=loss, **scope, peak_mem_bytes=peak, time=now)
                self.recorder.add(rec)
        self.recorder.flush()

    def flush_open(self) -> None:
        """A rank failing inside a window: record the steps it completed, each with this rank's own
        loss (`loss_scope: "rank"`: no collective, others may never get here). Never masks the error."""
        if all("loss" in rec for rec in self.records):  # none, or all written by close()
            return
        try:
            self._write(self.clock.resolve(self._marks), torch.stack(self._losses).float().tolist(), loss_scope="rank")
        except Exception as e:  # e.g. a broken CUDA context: the original error matters more
            log.debug("rank %d: could not record the open window: %s", self.ctx.rank, e)

"""The live progress line of a running job: step k of N, throughput, elapsed, ETA, and the
measured step time against the plan's, with a drift warning when they part for long.

Everything comes from the heartbeat files the ranks replace while they advance (the step each
had finished and its wall clock then: launcher.backends.monitor). A rank's rate is the steps
between two of its own beats over the time between them on its own clock (never another
host's), from its first beat after warm-up, so compile and the first steps do not count. The
line reports the slowest rank's rate: every step synchronises the ranks.

`Progress` is pure (beats in, text out); `LiveLine` draws it: in place on a terminal (rank output
scrolls above it), else one line every `PIPE_INTERVAL_S` on stderr, so logs stay readable and
scripts that parse stdout see only what they did before (as pip and git do). Never imports
runtime, drivers, cli or report.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import IO

from launcher.backends.monitor import Beat

# a line on stderr every this often when the console is not a terminal (CI logs, `| tee`);
# DLAUNCH_PROGRESS_INTERVAL_S sets it, 0 = none (the drift warning still prints)
PIPE_INTERVAL_S = float(os.environ.get("DLAUNCH_PROGRESS_INTERVAL_S", "10") or 0)
TTY_INTERVAL_S = 1.0
# The drift warning: the measured step time outside this band around the plan's prediction...
# (the band the GPU cost model meets on 98% of the published runs it is checked on,
# docs/benchmarks.md; CPU predictions on a quiet host meet it on most cells): an assumption
DRIFT_BAND = 0.25
# ... for this long of measured time after warm-up (DLAUNCH_DRIFT_SUSTAIN_S sets it), and over at least this many steps
DRIFT_SUSTAIN_S = float(os.environ.get("DLAUNCH_DRIFT_SUSTAIN_S") or 20.0)
DRIFT_MIN_STEPS = 10
# the pace the warning reports: the last few seconds
DRIFT_NOW_S = 5.0


@dataclass(frozen=True, kw_only=True)
class ProgressSpec:
    """What a run's progress is measured against."""

    total_steps: int
    warmup_steps: int
    samples_per_step: int  # the global batch
    units_per_sample: int = 1  # tokens per sample for sequence models
    unit: str = "samples"  # what throughput counts
    predicted_step_s: float | None = None  # the plan's; None: no plan, no comparison


@dataclass
class Progress:
    """Folds heartbeats into a progress line and, once, a drift warning."""

    spec: ProgressSpec
    start_s: float  # the caller's monotonic clock at launch
    _first: dict[int, Beat] = field(default_factory=dict)  # each rank's first beat after warm-up
    _last: dict[int, Beat] = field(default_factory=dict)
    # each rank's beats after warm-up within the last DRIFT_SUSTAIN_S of its clock
    _recent: dict[int, deque[Beat]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)  # what drift() said, for result.json

    def observe(self, beats: Mapping[int, Beat]) -> None:
        """Take the newest beats (every rank's, as read from the run dir)."""
        for rank, beat in beats.items():
            if beat.step >= max(1, self.spec.warmup_steps):
                self._first.setdefault(rank, beat)
                recent = self._recent.setdefault(rank, deque())
                if not recent or beat.step > recent[-1].step:
                    recent.append(beat)
                # keep one beat at or before the window's start, so the window spans it all
                while len(recent) > 2 and recent[1].time <= beat.time - DRIFT_SUSTAIN_S:
                    recent.popleft()
            self._last[rank] = beat

    def step(self) -> int:
        """Steps every rank has finished."""
        return min((b.step for b in self._last.values()), default=0)

    def step_time_s(self) -> tuple[float, float] | None:
        """(seconds per step of the slowest rank since warm-up, seconds measured); None until one advanced."""
        rates = [p[:2] for rank, first in self._first.items() if (p := _pace(first, self._last[rank]))]
        return max(rates) if rates else None

    def line(self, now_s: float, wall_s: float | None = None) -> str:
        """`step 57/200 (28%)  1,234 tokens/s  0.21 s/step (plan 0.19, x1.11)  elapsed 0:42  ETA 0:30`;
        before the rate is known `step 3/200  elapsed 0:05  warming up`. `wall_s`: this host's clock,
        to count the time since the slowest rank's last beat as spent (None: ranks on other hosts)."""
        s = self.spec
        done = self.step()
        head = f"step {done}/{s.total_steps} ({100 * done // max(1, s.total_steps)}%)"
        elapsed = f"elapsed {clock(now_s - self.start_s)}"
        measured = self.step_time_s()
        if measured is None:
            return f"{head}  {elapsed}  warming up"
        step_s = measured[0]
        rate = s.samples_per_step * s.units_per_sample / step_s
        parts = [head, f"{rate:,.0f} {s.unit}/s", f"{step_s:.3g} s/step"]
        if s.predicted_step_s:
            parts[-1] += f" (plan {s.predicted_step_s:.3g}, x{step_s / s.predicted_step_s:.2f})"
        left_s = step_s * max(0, s.total_steps - done)
        slowest = min(self._last.values(), key=lambda b: b.step)
        if wall_s is not None:
            left_s -= min(step_s, max(0.0, wall_s - slowest.time))  # within the step under way
        parts += [elapsed, f"ETA {clock(left_s)}"]
        return "  ".join(parts)

    def recent_step_time_s(self, span_s: float = DRIFT_SUSTAIN_S) -> tuple[float, float, int] | None:
        """(seconds per step, seconds, steps) of the slowest rank over its last `span_s` (at
        most DRIFT_SUSTAIN_S) after warm-up; None before any rank has two beats a step apart."""
        windows = []
        for recent in self._recent.values():
            last = recent[-1]
            first = next((b for b in reversed(recent) if b.time <= last.time - span_s), recent[0])
            if (pace := _pace(first, last)) is not None:
                windows.append(pace)
        return max(windows) if windows else None

    def drift(self) -> str | None:
        """The drift warning, once: the step time stayed outside DRIFT_BAND of the plan's for a whole
        DRIFT_SUSTAIN_S window (>= DRIFT_MIN_STEPS steps) after warm-up; None otherwise and after."""
        s = self.spec
        window = self.recent_step_time_s()
        if self.warnings or not s.predicted_step_s or window is None:
            return None
        mean_s, span_s, steps = window
        mean = mean_s / s.predicted_step_s
        if abs(mean - 1) <= DRIFT_BAND or span_s < DRIFT_SUSTAIN_S or steps < DRIFT_MIN_STEPS:
            return None
        now = self.recent_step_time_s(DRIFT_NOW_S) or window
        way = "slower" if mean > 1 else "faster"
        self.warnings.append(f"step time left the plan's +-{DRIFT_BAND:.0%} band during the run: {now[0]:.3g} s a "
                             f"step ({now[0] / s.predicted_step_s:.2f}x the plan's {s.predicted_step_s:.3g} s) at "
                             f"step {self.step()}")
        return (f"warning: steps take {now[0]:.3g} s now, {now[0] / s.predicted_step_s:.2f}x the plan's "
                f"{s.predicted_step_s:.3g} s ({mean:.2f}x over the last {span_s:.0f} s: {way} than its "
                f"+-{DRIFT_BAND:.0%} band); `dlaunch report` on the run dir says which part (compute, "
                "communication, data wait, a straggler rank) moved")


def _pace(first: Beat, last: Beat) -> tuple[float, float, int] | None:
    """(seconds per step, seconds, steps) from `first` to `last`; None unless both advanced."""
    if last.step > first.step and last.time > first.time:
        return (last.time - first.time) / (last.step - first.step), last.time - first.time, last.step - first.step
    return None


def clock(seconds: float) -> str:
    """`1:02:03` / `2:03`."""
    total = max(0, round(seconds))
    h, rest = divmod(total, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


class LiveLine:
    """Draws a `Progress` on a console from a thread; rank output goes through `above`."""

    def __init__(self, progress: Progress, console: IO[str], *,
                 beats: Callable[[], Mapping[int, Beat]], now: Callable[[], float] = time.monotonic,
                 write: Callable[[IO[str], str], bool],
                 locate: Callable[[], str | None] | None = None, pipe: IO[str] | None = None) -> None:
        self.progress, self.console, self.beats, self.now, self._write = progress, console, beats, now, write
        self.locate = locate  # after a drift warning: which rank holds the others up, if one does
        self.pipe = pipe if pipe is not None else sys.stderr  # where the lines go without a terminal
        self.tty = bool(getattr(console, "isatty", lambda: False)())
        self._lock = threading.Lock()
        self._drawn = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="dlaunch-progress")

    def start(self) -> None:
        """Begin drawing."""
        self._thread.start()

    def stop(self) -> None:
        """Stop drawing and leave the console on a fresh line."""
        self._stop.set()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout=5)
        with self._lock:
            if self._drawn:
                self._write(self.console, "\r\x1b[2K")
                self._drawn = ""

    def above(self, text: str) -> bool:
        """Write `text` (whole lines) above the progress line; False when the console is gone."""
        with self._lock:
            if not self._drawn:
                return self._write(self.console, text)
            return self._write(self.console, "\r\x1b[2K" + text + self._drawn)

    def _run(self) -> None:
        interval = TTY_INTERVAL_S if self.tty else PIPE_INTERVAL_S
        last = self.now()  # the first line after one interval
        while not self._stop.wait(TTY_INTERVAL_S):
            self.progress.observe(self.beats())
            warning = self.progress.drift()
            now = self.now()
            if warning is not None:
                self.above(f"dlaunch: {warning}\n")
                where = self.locate() if self.locate is not None else None
                if where:
                    self.progress.warnings[-1] += f"; {where}"
                    self.above(f"dlaunch: {where}\n")
            if interval <= 0 or now - last < interval:
                continue
            last = now
            text = "dlaunch: " + self.progress.line(now, time.time())
            with self._lock:
                if self.tty:
                    self._drawn = text
                    self._write(self.console, "\r\x1b[2K" + text)
                else:
                    self._write(self.pipe, text + "\n")


__all__ = ["Progress", "ProgressSpec", "LiveLine", "clock", "PIPE_INTERVAL_S", "DRIFT_BAND",
           "DRIFT_SUSTAIN_S"]

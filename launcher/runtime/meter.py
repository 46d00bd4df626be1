"""A tiny helper for plain torchrun scripts that run their own loop.

    from launcher.runtime.meter import StepMeter
    meter = StepMeter(samples_per_step=32)
    for batch in loader:
        ...                      # the script's own step
        meter.step(loss=loss)    # once per optimizer step; loss may be a float, a tensor or None

Under `dlaunch run` the steps land in the run dir like a workload's; without DLAUNCH_RUN_DIR the
meter does nothing. Timing is host wall time between calls: on CUDA exact only if the loop
synchronises (e.g. `loss.item()`).

Never imports cli, backends, jobs or report, nor torch (the script has its own).
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import time
from types import TracebackType
from typing import Any

from launcher.runtime.recorder import RankRecorder

_made: list[StepMeter] = []  # the script's own meters (see `recorders_made`)


def recorders_made() -> bool:
    """Whether the script made a StepMeter of its own (then launcher.runtime.bootstrap records none)."""
    return bool(_made)


class StepMeter:
    """Records one step per `step()` call into RUN_DIR/rank-<r>.jsonl."""

    def __init__(self, *, samples_per_step: int, sample_units: str = "samples",
                 units_per_sample: int = 1, flush_every: int = 10, auto: bool = False,
                 start_s: float | None = None) -> None:
        self.enabled = (run_dir := os.environ.get("DLAUNCH_RUN_DIR")) is not None
        if not auto:
            _made.append(self)
        self.samples_per_step = samples_per_step
        self.units_per_step = samples_per_step * units_per_sample
        self.flush_every = flush_every
        self.warmup_steps = int(os.environ.get("DLAUNCH_WARMUP_STEPS", "0"))
        self._step = 0
        self._last = time.perf_counter() if start_s is None else start_s  # perf_counter seconds
        self._recorder: RankRecorder | None = None
        if run_dir is None:
            return
        rank = int(os.environ.get("RANK", 0))
        self._recorder = RankRecorder(run_dir, rank, {
            "local_rank": int(os.environ.get("LOCAL_RANK", 0)), "node_rank": int(os.environ.get("GROUP_RANK", 0)),
            "world_size": int(os.environ.get("WORLD_SIZE", 1)),
            "host": os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
            "device": "script", "strategy": "script", "precision": "script",
            "sample_units": sample_units, "units_per_sample": units_per_sample})
        self._hook_exit()

    def step(self, loss: Any = None, *, data_wait_s: float = 0.0, samples: int | None = None,
             units: int | None = None) -> None:
        """Mark the end of one optimizer step (`samples` / `units`: this step's, when they vary)."""
        if self._recorder is None:
            return
        now = time.perf_counter()
        self._step += 1
        # tensors: one sync, the script's choice; no loss given is no loss recorded (a null
        # loss in a record is a NaN one)
        loss_record = {} if loss is None else {"loss": float(loss)}
        self._recorder.add({"kind": "step", "step": self._step, "time": time.time(),
                            "step_time_s": now - self._last, "data_wait_s": data_wait_s,
                            "samples": self.samples_per_step if samples is None else samples,
                            "units": self.units_per_step if units is None else units,
                            **loss_record, "peak_mem_bytes": None, "warmup": self._step <= self.warmup_steps})
        self._last = now
        if self._step % self.flush_every == 0:
            self._recorder.flush()

    def alive(self, what: str) -> None:
        """A sign of life between steps (see RankRecorder.alive)."""
        if self._recorder is not None:
            self._recorder.alive(what)

    def close(self, error: BaseException | None = None) -> None:
        """Write the summary (called automatically at exit)."""
        if self._recorder is not None:
            self._recorder.finish("failed" if error else "ok", error=error)

    def __enter__(self) -> StepMeter:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close(ev)

    def _hook_exit(self) -> None:
        previous = sys.excepthook

        def on_uncaught(et: type[BaseException], ev: BaseException, tb: TracebackType | None) -> None:
            self.close(ev)
            previous(et, ev, tb)

        sys.excepthook = on_uncaught
        atexit.register(self.close)

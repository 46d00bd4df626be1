"""Plain scripts measured without a line changed: torchrun starts each rank of a plain script
as `python -m launcher.runtime.bootstrap SCRIPT ARGS...`, which runs SCRIPT as `__main__` (as
`python SCRIPT` would) after hooking two things torch offers every training loop:

  - torch's global optimizer-step hook: one step record per optimizer step (an HF `Trainer`,
    Accelerate or a hand-written loop alike), with the host time since the previous step;
  - the DataLoader iterator: the batches the step consumed (samples: the batch's first
    dimension; tokens when the batch holds `input_ids`), and the time blocked in `__next__`
    (data wait). Several batches per optimizer step (gradient accumulation) add up.

Records go through the StepMeter a script could use itself; a script that makes its own
StepMeter is left to it, so nothing is counted twice. A script that feeds its model other than
through a DataLoader counts no samples. A batch fetched between steps (an evaluation loop) is a
sign of life for the hang watcher, not a step. Before its first step the rank beats once at start
and once a second for batches fetched (no pid: only a stepping script writes the summary the
watcher would then wait for), so the start-up allowance holds a script stuck before it steps as it
holds a workload. Without DLAUNCH_RUN_DIR it only runs the script.

Never imports cli, backends, drivers or report.
"""

from __future__ import annotations

import logging
import os
import runpy
import sys
import time
from typing import Any

from launcher.rundir import RunPaths
from launcher.runtime import meter as meters
from launcher.runtime.recorder import BEAT_INTERVAL_S, write_beat

log = logging.getLogger(__name__)


class AutoMeter:
    """Counts the DataLoader's batches and marks each optimizer step (see the module docstring)."""

    def __init__(self, run_dir: str) -> None:
        self.meter: meters.StepMeter | None = None
        self.samples = self.tokens = 0
        self.data_wait_s = 0.0
        self.started = time.perf_counter()
        self._beat_path = RunPaths(root=run_dir).heartbeat(int(os.environ.get("RANK", 0)))
        self._beats, self._beat_at = 0, 0.0
        self._starting_beat()

    def _starting_beat(self, busy: str | None = None) -> None:
        """The heartbeat before the first step (the module docstring); at most one a BEAT_INTERVAL_S."""
        if time.monotonic() - self._beat_at < BEAT_INTERVAL_S:
            return
        self._beat_at, self._beats = time.monotonic(), self._beats + (busy is not None)
        try:
            write_beat(self._beat_path, 0, busy=busy, busy_beats=self._beats)
        except OSError as e:  # a sign of life, not the script's business: a full disk must not end it
            log.debug("heartbeat not written: %s", e)

    def batch(self, batch: Any, waited_s: float) -> None:
        samples, tokens = batch_size(batch)
        self.samples += samples
        self.tokens += tokens
        self.data_wait_s += waited_s
        if self.meter is not None:
            self.meter.alive("fetching batches")
        elif not meters.recorders_made():  # a script's own meter beats for it
            self._starting_beat("fetching batches")

    def step(self) -> None:
        if self.meter is None:
            if meters.recorders_made():  # the script measures itself
                return
            units = "tokens" if self.tokens else "samples"
            per = max(1, round(self.tokens / self.samples)) if self.tokens and self.samples else 1
            # the first step timed from the script's start (a warm-up step)
            self.meter = meters.StepMeter(samples_per_step=0, sample_units=units, units_per_sample=per, auto=True,
                                          start_s=self.started)
        self.meter.step(data_wait_s=self.data_wait_s, samples=self.samples, units=self.tokens or self.samples)
        self.samples = self.tokens = 0
        self.data_wait_s = 0.0


def batch_size(batch: Any) -> tuple[int, int]:
    """(samples, tokens) of one batch: the leading dimension of its first tensor (a tensor, a
    tuple or list, a dict), and the elements of `input_ids` when it has them (0 otherwise)."""
    import torch

    if isinstance(batch, torch.Tensor):
        return (int(batch.shape[0]) if batch.dim() else 1), 0
    if isinstance(batch, dict) or hasattr(batch, "keys"):
        ids = batch.get("input_ids") if hasattr(batch, "get") else None
        tokens = int(ids.numel()) if isinstance(ids, torch.Tensor) else 0
        first = next((v for v in batch.values() if isinstance(v, torch.Tensor) and v.dim()), None)
        return (int(first.shape[0]) if first is not None else 0), tokens
    if isinstance(batch, tuple | list) and batch:
        return batch_size(batch[0])[0], 0
    return 0, 0


def install(auto: AutoMeter) -> None:
    """Hook torch's optimizer steps and DataLoader batches into `auto`."""
    from torch.optim import optimizer
    from torch.utils.data import dataloader

    optimizer.register_optimizer_step_post_hook(lambda *_: auto.step())
    fetch = dataloader._BaseDataLoaderIter.__next__

    def timed_next(self: Any) -> Any:
        if getattr(self, "_num_workers", 0) > 0 and not getattr(self, "_dlaunch_checked", False):
            # before a first batch that would hang (imported here: most loaders have no workers)
            from launcher.runtime.loader import check_worker_sockets
            check_worker_sockets(self._num_workers)
            self._dlaunch_checked = True
        began = time.perf_counter()
        batch = fetch(self)
        auto.batch(batch, time.perf_counter() - began)
        return batch

    dataloader._BaseDataLoaderIter.__next__ = timed_next  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m launcher.runtime.bootstrap SCRIPT [ARGS...]", file=sys.stderr)
        raise SystemExit(2)
    script = os.path.abspath(args[0])
    sys.argv = [args[0], *args[1:]]
    sys.path[0] = os.path.dirname(script)  # as `python SCRIPT` sets it
    if run_dir := os.environ.get("DLAUNCH_RUN_DIR"):
        install(AutoMeter(run_dir))
    try:
        runpy.run_path(script, run_name="__main__")
    except Exception as e:  # told as `python SCRIPT` tells it: from the script's own frames, not runpy's or ours
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != script:
            tb = tb.tb_next
        tb = tb or e.__traceback__  # none of its own (it did not compile): all, with the header the post-mortem reads
        sys.excepthook(type(e), e.with_traceback(tb), tb)  # a script's StepMeter hooks it to write its summary
        raise SystemExit(1) from None  # the exit code of an uncaught exception


if __name__ == "__main__":
    main()

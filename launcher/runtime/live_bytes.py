"""Peak live tensor bytes on CPU, the ground truth the memory model is checked against.

CUDA has `torch.cuda.max_memory_allocated`; CPU has no allocator statistics, so this
TorchDispatchMode counts every new output storage when an op creates it and uncounts it when
the storage is freed (`weakref.finalize` on the storage, whose Python object torch keeps
alive exactly as long as the storage). Tensors that exist before entering (parameters) are
added with `add_existing`.

`StepSampler` runs it for one training step of a rank on CPU, the last warm-up step: the
optimizer state exists by then, and a warm-up step is out of every measured number, so the
measurement costs the run's results nothing (the tracked step itself runs slower: every op
goes through Python). It samples DDP runs (one rank or more) without torch.compile; FSDP's
DTensor parameters and compiled graphs are not seen by the mode, so those are not sampled.

Imports torch at module level, as every module behind the rank's door does (see
runtime/__init__); the CLI and the planner never import it (benchmarks do, for the memory check).
Never imports any other part of dlaunch.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

log = logging.getLogger(__name__)


class LiveBytes(TorchDispatchMode):
    """Tracks live and peak bytes of tensor storages created while active."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._tracked: set[int] = set()

    def add_existing(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count tensors made before the mode was entered (e.g. parameters)."""
        for t in tensors:
            self._track(t)

    def reset_peak(self) -> None:
        """Start a new peak from the current live bytes."""
        self.peak = self.live

    def _free(self, key: int, nbytes: int) -> None:
        self._tracked.discard(key)
        self.live -= nbytes

    def _track(self, t: Any) -> None:
        # wrapper subclasses (DTensor) have no storage of their own
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type == "meta":
            return
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._tracked:
            return
        self._tracked.add(key)
        n = storage.nbytes()
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, n)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self._track(t)
        return out


# the fewest warm-up steps for a representative sample: step 1 creates the optimizer state
SAMPLE_MIN_WARMUP = 2


class StepSampler:
    """Peak live tensor bytes of one step: `begin(step)` before it, `end(step, record)` after.

    Counts the module's parameters, buffers and gradients and the optimizer's state as they
    are when the step begins, then every storage the step creates; `end` puts the peak in the
    step's record as `live_peak_bytes`. Every other step costs one integer comparison.
    """

    def __init__(self, *, step: int | None, module: torch.nn.Module,
                 optimizer: torch.optim.Optimizer) -> None:
        self.step = step  # None: samples nothing
        self._module, self._optimizer = module, optimizer
        self._mode: LiveBytes | None = None

    @classmethod
    def for_rank(cls, *, device_type: str, strategy: str, compiled: bool, start: int,
                 warmup_steps: int, steps: int, module: torch.nn.Module,
                 optimizer: torch.optim.Optimizer) -> StepSampler:
        """The sampler of a rank: on CPU it samples the attempt's last warm-up step. It samples
        nothing where that would not measure what the plan estimates: CUDA has allocator
        statistics; FSDP and compiled graphs are invisible to the mode; fewer than 2 warm-up
        steps leave no warm-up step that starts with the optimizer state in place."""
        step: int | None = start + warmup_steps
        if (device_type != "cpu" or strategy != "ddp" or compiled
                or warmup_steps < SAMPLE_MIN_WARMUP or start + warmup_steps > steps):
            step = None
        return cls(step=step, module=module, optimizer=optimizer)

    def begin(self, step: int) -> None:
        """Start tracking when `step` is the sampled one."""
        if step != self.step:
            return
        mode = LiveBytes()
        state = (v for s in self._optimizer.state.values() for v in s.values())
        mode.add_existing(t for t in itertools.chain(self._module.parameters(), self._module.buffers(),
                                                     (p.grad for p in self._module.parameters()), state)
                          if isinstance(t, torch.Tensor))
        mode.reset_peak()
        mode.__enter__()
        self._mode = mode

    def end(self, step: int, record: dict[str, Any]) -> None:
        """Stop tracking after the sampled step and add its peak to the step's record."""
        mode = self._mode
        if mode is None or step != self.step:
            return
        self.abort()
        peak = mode.peak
        # keep "warmup" right before the "step_time_s" the window appends: the report reads
        # step times with one regular expression over that layout (report.runs)
        warmup = record.pop("warmup", None)
        record["live_peak_bytes"] = peak
        if warmup is not None:
            record["warmup"] = warmup

    def abort(self) -> None:
        """Leave the mode (the step failed, or it is over); idempotent."""
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None

"""Peak live tensor bytes on CPU, the ground truth the memory model is checked against.

CUDA has `torch.cuda.max_memory_allocated`; CPU has no allocator statistics, so this
TorchDispatchMode counts every new output storage when an op creates it and uncounts it when
the storage is freed (`weakref.finalize` on the storage, whose Python object torch keeps
alive exactly as long as the storage). Tensors that exist before entering (parameters) are
added with `add_existing`.

Imports torch at module level, so no rank, CLI or planner path may import it; never imports any
other part of dlaunch.
"""

from __future__ import annotations

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
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
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

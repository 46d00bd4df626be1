"""Time a step spends in tensor parallelism's collectives, measured on CPU.

Tensor parallelism (DTensor, `parallelize_module`) communicates inside forward and backward,
through functional collectives (`_c10d_functional.*`) on the tp process group, and without async
TP nothing overlaps them. The sync-off calibration (runtime.calibrate) cannot switch them off
(the math needs them), so `exposed_comm_s` there is the data-parallel dimension's alone. Here one
more pass of the last step's micro-batches runs under a dispatch mode that adds up the wall time
inside each functional collective on the tp group and inside the wait for its result:
`tp_comm_s`, seconds a step.

On CPU (gloo) the caller blocks in those calls for as long as the collective takes. On CUDA
(NCCL) they only enqueue work, so the host-side sum would say nothing and is not taken there (a
`--profile` trace shows the kernels).

Never imports cli, backends, jobs or report; torch at module level (see runtime/__init__).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_FUNCTIONAL = "_c10d_functional"


class CollectiveClock(TorchDispatchMode):
    """Adds up seconds inside functional collectives on `group` and inside their waits."""

    def __init__(self, group: str) -> None:
        super().__init__()
        self.group, self.seconds, self.calls = group, 0.0, 0
        self._ours: set[int] = set()  # results of our group's collectives not yet waited for

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace != _FUNCTIONAL:
            return func(*args, **kwargs)
        waited = func.__name__.startswith("wait_tensor")
        ours = (id(args[0]) in self._ours) if waited else self.group in (*args, *kwargs.values())
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        if ours:
            self.seconds += time.perf_counter() - t0
            if waited:
                self._ours.discard(id(args[0]))
            else:
                self.calls += 1
                self._ours.update(id(t) for t in (out if isinstance(out, (list, tuple)) else [out])
                                  if isinstance(t, torch.Tensor))
        return out


def tp_comm_s(replay: Callable[[], object], group: str) -> dict[str, Any]:
    """`tp_comm_s` (seconds in TP's collectives during `replay`) and `tp_collectives` (their count)."""
    clock = CollectiveClock(group)
    with clock:
        replay()
    return {"tp_comm_s": clock.seconds, "tp_collectives": clock.calls}

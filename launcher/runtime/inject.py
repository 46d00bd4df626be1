"""Fault and delay injection, for tests that check dlaunch measures what really happened.

Set in the ranks' environment:
  DLAUNCH_INJECT_COMM_DELAY_MS=X   every DDP gradient all-reduce sleeps X ms before it starts

Never imports cli, backends, jobs or report; torch at module level (see runtime/__init__).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

log = logging.getLogger(__name__)


def comm_delay_ms(env: dict[str, str] | None = None) -> float:
    """The injected delay per all-reduce, 0 when none is set."""
    e = os.environ if env is None else env
    return float(e.get("DLAUNCH_INJECT_COMM_DELAY_MS", "0") or 0)


def install_comm_delay(ddp: DistributedDataParallel, delay_ms: float, hook: Any = None) -> None:
    """Register a DDP comm hook that sleeps, then runs `hook` (the run's own; None: the default all-reduce)."""
    hook = hook or allreduce_hook
    # no annotations: DDP rejects a hook whose `bucket` annotation is not dist.GradBucket
    def delayed(state, bucket):  # type: ignore[no-untyped-def]
        time.sleep(delay_ms / 1000.0)
        return hook(state, bucket)

    ddp.register_comm_hook(state=None, hook=delayed)
    log.warning("injected %.1f ms before every gradient all-reduce", delay_ms)

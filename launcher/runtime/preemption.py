"""Preemption signals: a request to stop that the harness acts on where every rank meets.

SIGUSR2 (SLURM's preemption / time-limit signal, `--signal USR2@90`) and, under SLURM, SIGTERM
(what `scontrol requeue`, `scancel` and a preempting job send to every process of the step)
only set a flag (`Preemption`): a Python handler cannot save from inside a collective, and
ranks stopping at different steps would leave the others waiting in the next all-reduce. The
flag rides along in the window's loss all-reduce; when any rank set it, all save at that step
and end `preempted` (see runtime.resume). Locally SIGTERM keeps meaning "torchrun is ending the
job" (entry.Stopped): another rank failed, and a collective with it would never complete.

Torch-free: the rank's entry reads the flag (`stop_requested`) whenever the rank ends, also
when torch never loaded. Never imports cli, backends, jobs or report.
"""

from __future__ import annotations

import os
import signal
from types import FrameType
from typing import Any

# set from a signal handler; module-level because handlers are process-wide
_requested: dict[str, str | None] = {"signal": None}


def stop_requested() -> str | None:
    """The name of the signal that asked this rank to stop (SIGUSR2, SIGTERM), or None."""
    return _requested["signal"]


def under_slurm(env: dict[str, str] | None = None) -> bool:
    """True in a rank the SLURM backend started (it sets DLAUNCH_SLURM_RESTART_COUNT)."""
    e = os.environ if env is None else env
    return "DLAUNCH_SLURM_RESTART_COUNT" in e


class Preemption:
    """Signal handlers that turn SIGUSR2 (and SIGTERM under SLURM) into a stop flag, around the
    training loop; the previous handlers (entry's SIGTERM handler) come back on exit."""

    def __init__(self, *, sigterm: bool) -> None:
        self.signals = [signal.SIGUSR2] + ([signal.SIGTERM] if sigterm else [])
        self._old: dict[int, Any] = {}

    def __enter__(self) -> Preemption:
        _requested["signal"] = None
        for sig in self.signals:
            self._old[sig] = signal.signal(sig, _on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    @property
    def requested(self) -> bool:
        """True once one of the signals arrived at this rank."""
        return _requested["signal"] is not None


def _on_signal(signum: int, frame: FrameType | None) -> None:
    # only a flag: the harness acts on it at the next window end, where all ranks meet
    # (no print here: a handler that writes while the main thread is writing raises
    # "reentrant call"; the harness says what it does when it acts)
    if _requested["signal"] is None:
        _requested["signal"] = signal.Signals(signum).name

"""Whether a process a file names still runs: the one liveness check of dlaunch.

Run dirs (`owner.json`), sweep locks and rank heartbeats name pids; a pid is reused by the
system once its process is gone, so a pid counts only if its process started no later than the
moment the file named it. A zombie does not count: it has finished, unreaped by its parent.

A leaf module: imports psutil and nothing of launcher.
"""

from __future__ import annotations

import psutil

# create_time() and the time a file records come from different clocks' rounding: allow 1 s
_CLOCK_SLACK_S = 1.0


def pid_alive(pid: int, *, not_after: float | None = None) -> bool:
    """True when `pid` runs (a zombie does not) and, given `not_after` (a time.time()), started by then."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return not_after is None or proc.create_time() <= not_after + _CLOCK_SLACK_S
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False

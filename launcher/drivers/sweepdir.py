"""Sweep directories: the lock, point directories moved aside, and finished points.

The counterpart of rundir.py for sweeps (file names in `launcher.rundir.SweepPaths`, layout in
launcher/drivers/sweep.py). Never imports cli, runtime or report.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from launcher.drivers.launch import read_result
from launcher.errors import LaunchError, UsageError
from launcher.procs import pid_alive
from launcher.results.types import RunResult
from launcher.rundir import SweepPaths

log = logging.getLogger(__name__)


def refuse_foreign(sweep_dir: Path) -> None:
    """UsageError unless `sweep_dir` is absent, empty, or a dlaunch sweep (its manifest, or only
    the lock of a sweep stopped before writing one): a sweep moves and rewrites what it finds."""
    paths = SweepPaths(root=sweep_dir)
    if not sweep_dir.exists():
        return
    if not sweep_dir.is_dir():
        raise UsageError(f"--sweep-dir {str(sweep_dir)!r} exists and is not a directory; give a new directory")
    if paths.manifest.exists():
        return
    if foreign := sorted(e.name for e in sweep_dir.iterdir() if e != paths.lock):
        raise UsageError(f"--sweep-dir {str(sweep_dir)!r} is not empty and holds no dlaunch sweep "
                         f"(no {paths.manifest.name}; found {foreign[0]!r}); give a new or empty directory")


def first_difference(a: Any, b: Any, prefix: str = "") -> str:
    """`key.sub: old before, new now` for the first key where two configs differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return first_difference(a.get(k), b.get(k), f"{prefix}{k}.")
    return f"{prefix.rstrip('.')}: {a!r} before, {b!r} now"


def acquire_lock(sweep_dir: Path) -> Path:
    """Refuse a second sweep in the same directory; take over a dead one's lock."""
    path = SweepPaths(root=sweep_dir).lock
    me = {"pid": os.getpid(), "host": socket.gethostname()}
    for _ in range(2):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            try:
                held = json.loads(path.read_text() or "{}")
            except (OSError, ValueError):
                held = {}
            pid = int(held.get("pid", 0) or 0)
            if held.get("host") == me["host"] and pid and pid_alive(pid):
                raise LaunchError(f"another dlaunch scale (pid {pid}) is running in {sweep_dir}; "
                                  "wait for it or give another --sweep-dir") from None
            log.warning("taking over the stale lock of %s (pid %s)", sweep_dir, pid)
            path.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        return path
    raise LaunchError(f"cannot lock {sweep_dir}: {path} keeps reappearing")


def move_aside(point_dir: Path, sweep_dir: Path) -> Path:
    """Keep what a point left behind under .attempts/ (never delete measurements)."""
    dest_root = SweepPaths(root=sweep_dir).moved_aside
    dest_root.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    dest = dest_root / f"{point_dir.name}-{stamp}"
    n = 1
    while dest.exists():
        n += 1
        dest = dest_root / f"{point_dir.name}-{stamp}-{n}"
    shutil.move(str(point_dir), str(dest))
    return dest


def finished_ok(point_dir: Path) -> RunResult | None:
    """The point's result when its result.json exists and says ok, else None."""
    result = read_result(point_dir)
    return result if result is not None and result.status == "ok" else None

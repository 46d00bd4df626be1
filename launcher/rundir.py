"""Run directories: unique ids, creation that never reuses a directory, the launch spec file."""

from __future__ import annotations

import logging
import os
import re
import secrets
import time
from pathlib import Path

from launcher.errors import LaunchError

log = logging.getLogger(__name__)

_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")
PLAN_FILE = "plan.json"  # the plan a run followed, beside its results (predicted vs measured)


def new_run_id(workload: str) -> str:
    """`<stem>-<UTC time>-<random>`: sortable, and unique across concurrent launches."""
    stem = _SAFE.sub("-", Path(workload).stem)[:40] or "run"
    return f"{stem}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"


def create_run_dir(path: str | Path | None, run_id: str, *, root: str | Path = "runs") -> Path:
    """Create the run directory (mode 0750, never world-writable) and return its absolute path.

    An explicit path may exist only if it is empty, so two runs never share one.
    """
    p = Path(path) if path is not None else Path(root) / run_id
    p = p.expanduser().absolute()
    blocker = next((a for a in p.parents if a.exists() and not a.is_dir()), None)
    if blocker is not None:
        raise LaunchError(f"cannot create run dir {str(p)!r}: {str(blocker)!r} is a file, not a "
                          "directory; give a writable --run-dir")
    try:
        _make_parents(p)
        try:
            p.mkdir(mode=0o750)
        except FileExistsError:
            if not p.is_dir():
                raise LaunchError(f"--run-dir {str(path)!r} exists and is not a directory; "
                                  "give a new directory") from None
            if any(p.iterdir()):
                raise LaunchError(f"--run-dir {str(path)!r} already holds a run; "
                                  "give a new or empty directory") from None
        probe = p / ".write-test"
        probe.write_text("")
        probe.unlink()
        os.chmod(p, 0o750)  # an existing empty --run-dir too: never world-writable
    except PermissionError:
        raise LaunchError(f"cannot write to run dir {str(p)!r} (permission denied); "
                          "give a writable --run-dir") from None
    except OSError as e:
        raise LaunchError(f"cannot create run dir {str(p)!r}: {e.strerror}; "
                          "give a writable --run-dir") from None
    return p


def _make_parents(p: Path) -> None:
    """mkdir -p of p's parents, each new one 0755 whatever the umask (`runs/` is shared by
    every run; with umask 000 `Path.mkdir(parents=True)` would make it world-writable)."""
    missing = [a for a in reversed(p.parents) if not a.exists()]
    for d in missing:
        try:
            d.mkdir(mode=0o755)
        except FileExistsError:  # a concurrent launch made it first
            continue
        os.chmod(d, 0o755)

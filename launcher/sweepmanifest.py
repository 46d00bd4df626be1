"""The sweep manifest's format: reading `SweepPaths.manifest` back (its writer is the sweep
driver, launcher/jobs/sweep.py). Beside rundir.py, because both the sweep driver and the report
read it and neither may import the other.

Imports only launcher.errors, launcher.files and launcher.rundir.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from launcher.errors import UsageError
from launcher.files import read_json
from launcher.rundir import SweepPaths


def read_manifest(sweep_dir: str | Path) -> dict[str, Any] | None:
    """The manifest of a sweep directory, or None when there is none."""
    path = SweepPaths(root=sweep_dir).manifest
    if not path.exists():
        return None
    try:
        data = read_json(path)
    except ValueError as e:
        raise UsageError(f"{path} is not valid JSON ({e}); move it away to start a new sweep") from None
    if not isinstance(data, dict) or data.get("kind") != "sweep":
        raise UsageError(f"{path} is not a dlaunch sweep manifest")
    return data

"""The sweep manifest (`SweepPaths.manifest`, sweep.json): its typed form, its writer and its
reader. Beside rundir.py, because both the sweep driver (launcher/drivers/sweep.py) and the
report read it and neither may import the other. A manifest written before the knobs were
renamed is read in today's names (`knobs.migrate`), so an older dlaunch's sweep resumes in place.

Imports only launcher.errors, launcher.files, launcher.knobs and launcher.rundir.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.errors import UsageError
from launcher.files import atomic_write_json, read_json
from launcher.knobs import migrate
from launcher.rundir import SweepPaths


@dataclass(frozen=True, kw_only=True)
class SweepPoint:
    """One point of a sweep, as recorded in the manifest."""

    name: str  # ws<N>-r<k>, also the directory name
    world_size: int
    repeat: int
    micro_batch: int
    global_batch: int
    num_nodes: int = 1
    status: str = "pending"  # pending | running | ok | failed
    run_id: str = ""
    error: str | None = None
    attempts: int = 0
    started: float | None = None
    finished: float | None = None
    samples_per_s: float | None = None
    step_time_median_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """A sweep's configuration (what a re-run must match to resume it) and every point."""

    name: str
    mode: str | None
    config: Mapping[str, Any]
    created: float = 0.0
    topology: Mapping[str, Any] | None = None  # for busbw beside the link bandwidth
    points: tuple[SweepPoint, ...] = ()
    updated: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """sweep.json's content, its keys in the order they always had."""
        ordered = sorted(self.points, key=lambda p: (p.world_size, p.repeat))
        return {"kind": "sweep", "version": 1, "name": self.name, "mode": self.mode, "config": dict(self.config),
                "created": self.created, "topology": self.topology, "points": [dataclasses.asdict(p) for p in ordered],
                "updated": self.updated, "world_sizes": sorted({p.world_size for p in ordered})}


def write_manifest(sweep_dir: str | Path, manifest: Manifest) -> None:
    """Rewrite sweep.json (atomically)."""
    atomic_write_json(SweepPaths(root=sweep_dir).manifest, manifest.to_dict())


def read_manifest(sweep_dir: str | Path) -> Manifest | None:
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
    config = dict(data.get("config") or {})
    if isinstance(config.get("spec"), Mapping):
        config["spec"] = migrate(config["spec"])
    names = {f.name for f in dataclasses.fields(SweepPoint)}
    try:
        points = tuple(SweepPoint(**{k: v for k, v in p.items() if k in names}) for p in data.get("points") or [])
        return Manifest(name=str(data.get("name", Path(sweep_dir).name)), mode=data.get("mode"),
                        config=config, created=float(data.get("created") or 0.0),
                        topology=data.get("topology"), points=points, updated=data.get("updated"))
    except (TypeError, ValueError, AttributeError):
        raise UsageError(f"{path} is not a dlaunch sweep manifest (a point is malformed)") from None

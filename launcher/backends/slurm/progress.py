"""Progress of a running job from its rank files on the shared filesystem.

Ranks append whole JSON lines to `rank-<r>.jsonl` at the end of each logging window (and at
least every few seconds), so the launcher — possibly on another machine than the ranks — reads
only what was appended since the last look, and only whole lines.

Never imports launcher.runtime (it reads the ranks' files), drivers, cli or report.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from launcher.files import read_jsonl
from launcher.rundir import RECORDS, RunPaths

log = logging.getLogger(__name__)


class Progress:
    """Incremental reader of every rank's records: steps done and current throughput."""

    def __init__(self, run_dir: Path, world_size: int, steps: int) -> None:
        self.run_dir = run_dir
        self.world_size = world_size
        self.steps = steps
        self._offsets: dict[int, int] = {}
        self._last_step: dict[int, dict[str, Any]] = {}
        self._hosts: dict[int, str] = {}
        self._units = "samples"
        self._printed = ""

    def _read_new(self, rank: int) -> None:
        path = RunPaths(root=self.run_dir).records(rank)
        offset = self._offsets.get(rank, 0)
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n")
        if end < 0:
            return  # nothing new, or a line still being written
        self._offsets[rank] = offset + end + 1
        for raw in data[:end + 1].splitlines():
            try:
                rec = json.loads(raw)
            except ValueError:
                continue
            kind = rec.get("kind")
            if kind == "step":
                self._last_step[rank] = rec
            elif kind == "start":
                self._hosts[rank] = str(rec.get("host", "?"))
                self._last_step.pop(rank, None)  # a requeued attempt starts over
            elif kind == "workload" and rec.get("sample_units"):
                self._units = str(rec["sample_units"])

    def snapshot(self) -> dict[str, Any]:
        """Steps per rank, hosts seen and the current throughput (sum over ranks)."""
        for rank in range(self.world_size):
            self._read_new(rank)
        steps = {r: int(rec.get("step", 0)) for r, rec in self._last_step.items()}
        rate = 0.0
        for rec in self._last_step.values():
            t = float(rec.get("step_time_s") or 0.0)
            if t > 0:
                rate += float(rec.get("samples", 0)) / t
        return {"started": len(self._hosts), "steps": steps, "hosts": sorted(set(self._hosts.values())),
                "samples_per_s": rate, "units": self._units}

    def line(self) -> str | None:
        """A progress line, or None when nothing changed since the last one."""
        snap = self.snapshot()
        if not snap["started"]:
            text = f"waiting for the ranks to start (0/{self.world_size})"
        elif not snap["steps"]:
            text = (f"{snap['started']}/{self.world_size} rank(s) started on "
                    f"{', '.join(snap['hosts'])}; no step recorded yet")
        else:
            per_rank = " ".join(str(snap["steps"].get(r, 0)) for r in range(self.world_size))
            done = min(snap["steps"].get(r, 0) for r in range(self.world_size))
            text = (f"step {done}/{self.steps} (per rank: {per_rank}) on {', '.join(snap['hosts'])}, "
                    f"{snap['samples_per_s']:,.1f} samples/s")
        if text == self._printed:
            return None
        self._printed = text
        return text


def first_step_time(run_dir: Path) -> float | None:
    """Host clock at the end of the earliest first step of any rank (None if none ran)."""
    times = []
    for path in RunPaths(root=run_dir).rank_files(RECORDS).values():
        records, _ = read_jsonl(path)
        for rec in records:
            if rec.get("kind") == "step" and rec.get("step") == 1:
                times.append(float(rec.get("end_time") or rec.get("time") or 0.0))
                break
    times = [t for t in times if t > 0]
    return min(times) if times else None

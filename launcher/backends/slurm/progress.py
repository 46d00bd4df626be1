"""Progress of a running job from its rank files on the shared filesystem.

Ranks append whole JSON lines to `rank-<r>.jsonl` at the end of each logging window (and at least
every few seconds), so the launcher — possibly on another machine than the ranks — reads only what
was appended since the last look, and only whole lines. Never imports launcher.runtime (it reads
the ranks' files), drivers, cli or report.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from launcher.files import read_jsonl, read_new
from launcher.rundir import RECORDS, RunPaths


class Progress:
    """Incremental reader of every rank's records: steps done and current throughput."""

    def __init__(self, run_dir: Path, world_size: int, steps: int | None) -> None:  # None: a script's own count
        self.run_dir, self.world_size, self.steps = run_dir, world_size, steps
        self._offsets: dict[Path, int] = {}
        self._last_step: dict[int, dict[str, Any]] = {}
        self._hosts: dict[int, str] = {}
        self._units = "samples"
        self._printed = ""

    def _read_new(self, rank: int) -> None:
        try:
            text = read_new(RunPaths(root=self.run_dir).records(rank), self._offsets, whole_lines=True)
        except FileNotFoundError:
            return
        for raw in text.splitlines():
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
        rate = sum((float(rec.get("samples", 0)) / t for rec in self._last_step.values()
                    if (t := float(rec.get("step_time_s") or 0.0)) > 0), 0.0)
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
            of = "" if self.steps is None else f"/{self.steps}"
            text = (f"step {done}{of} (per rank: {per_rank}) on {', '.join(snap['hosts'])}, "
                    f"{snap['samples_per_s']:,.1f} samples/s")
        if text == self._printed:
            return None
        self._printed = text
        return text


def first_step_time(run_dir: Path) -> float | None:
    """Host clock at the end of the earliest first step of any rank (None if none ran)."""
    times = []
    for path in RunPaths(root=run_dir).rank_files(RECORDS).values():
        first = next((r for r in read_jsonl(path)[0] if r.get("kind") == "step" and r.get("step") == 1), None)
        if first is not None and (t := float(first.get("end_time") or first.get("time") or 0.0)) > 0:
            times.append(t)
    return min(times, default=None)

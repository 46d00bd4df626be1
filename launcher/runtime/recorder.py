"""Per-rank metrics: `RUN_DIR/rank-<r>.jsonl` (appended in whole lines) and
`RUN_DIR/rank-<r>.summary.json` (written atomically once, at the end).

Records (one JSON object per line, `kind` first):
  start  rank, local_rank, node_rank, world_size, host, pid, device, strategy, precision,
         sample_units, units_per_sample, micro_batch, grad_accum_steps, time
  step   step, time, end_time (host clock at the step's end), step_time_s, data_wait_s, samples, units, loss, peak_mem_bytes, warmup
  comm   calibration of communication (see harness)
  end    time, steps, status
The heartbeat file `rank-<r>.heartbeat` holds the last step and its wall time.
"""

from __future__ import annotations

import json
import logging
import os
import time
import traceback as tb
from pathlib import Path
from typing import Any

from launcher.files import append_lines, atomic_write_json

log = logging.getLogger(__name__)


class RankRecorder:
    """Buffers step records and appends them at window ends; writes the final summary."""

    def __init__(self, run_dir: str | Path, rank: int, start: dict[str, Any]) -> None:
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.path = self.run_dir / f"rank-{rank}.jsonl"
        self._heartbeat = self.run_dir / f"rank-{rank}.heartbeat"
        self._buffer: list[dict[str, Any]] = []
        self.steps_done = 0
        self._finished = False
        append_lines(self.path, [{"kind": "start", "rank": rank, "pid": os.getpid(),
                                  "time": time.time(), **start}])
        self.heartbeat(0)

    def add(self, record: dict[str, Any]) -> None:
        """Queue a record (written at the next flush)."""
        self._buffer.append(record)
        if record.get("kind") == "step":
            self.steps_done = max(self.steps_done, int(record["step"]))

    def flush(self) -> None:
        """Append every queued record in one write, then beat the heartbeat."""
        if self._buffer:
            append_lines(self.path, self._buffer)
            self._buffer = []
        self.heartbeat(self.steps_done)

    def heartbeat(self, step: int) -> None:
        """Record progress for the launcher's hang detection (small file, replaced atomically)."""
        tmp = self._heartbeat.with_suffix(".heartbeat.tmp")
        tmp.write_text(json.dumps({"step": step, "time": time.time(), "pid": os.getpid()}))
        os.replace(tmp, self._heartbeat)

    def finish(self, status: str, *, error: BaseException | None = None,
               extra: dict[str, Any] | None = None) -> None:
        """Flush, append the end record and write the summary; only the first call counts."""
        if self._finished:
            return
        self._finished = True
        self.flush()
        now = time.time()
        summary: dict[str, Any] = {"rank": self.rank, "status": status, "steps": self.steps_done,
                                   "time": now, **(extra or {})}
        if error is not None:
            summary["error"] = f"{type(error).__name__}: {error}".strip()
            summary["traceback"] = "".join(tb.format_exception(error))
        append_lines(self.path, [{"kind": "end", "time": now, "steps": self.steps_done,
                                  "status": status}])
        atomic_write_json(self.run_dir / f"rank-{self.rank}.summary.json", summary)

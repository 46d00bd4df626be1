"""Durable file writes: whole files appear atomically, records are appended as whole lines.

A reader (the launcher, `dlaunch report`) may read while a rank writes or after a rank was
killed, so it must never see half a JSON document; see `read_jsonl` for the reading side.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write `text` to `path` through a temp file in the same directory and a rename."""
    p = Path(path)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | Path, data: Any) -> None:
    """`atomic_write_text` of an indented JSON document."""
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def append_lines(path: str | Path, records: Iterable[dict[str, Any]]) -> None:
    """Append JSON records, one per line, in a single write so lines are never interleaved."""
    payload = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records)
    if not payload:
        return
    # O_APPEND makes each write land at the end even with several writers
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, payload.encode("utf-8"))
    finally:
        os.close(fd)


def read_jsonl(path: str | Path) -> tuple[list[dict[str, Any]], str | None]:
    """Every whole record of a JSON-lines file, and a note when a cut-off tail was dropped."""
    records: list[dict[str, Any]] = []
    note = None
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.endswith("\n"):
                note = f"{Path(path).name}: last line {n} is cut off (rank killed mid-write?); ignored"
                break
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                note = f"{Path(path).name}: line {n} is not JSON; read up to line {n - 1}"
                break
    return records, note


def read_json(path: str | Path) -> Any:
    """Parse a JSON file."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)

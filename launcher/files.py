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


def atomic_write_text(path: str | Path, text: str, *, fsync: bool = True) -> None:
    """Write `text` to `path` through a temp file in the same directory and a rename.

    The temp file is created 0600 (mkstemp), so the result is never world-writable whatever
    the umask. `fsync=False` is for files rewritten every second (heartbeats): a crash of the
    machine may lose the last version, but a reader never sees a partial one.
    """
    p = Path(path)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            if fsync:
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
    data = payload.encode("utf-8")
    # O_APPEND makes each write land at the end even with several writers
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        # one write() almost always takes it all; a short write (signal, full disk) must not
        # leave half a line that the next record would be glued to, so finish the job
        while data:
            written = os.write(fd, data)
            data = data[written:]
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

"""Durable file writes and guarded reads: the one place dlaunch turns files into data and back.

Writes: whole files appear atomically, records are appended as whole lines. A reader (the
launcher, `dlaunch report`) may read while a rank writes or after a rank was killed, so it must
never see half a JSON document; see `read_jsonl` for the reading side. Every JSON document is
strict JSON (a NaN loss is written as null): other tools' parsers refuse bare `NaN`.

Reads of user-supplied YAML (topology files, dlaunch.yaml) go through `read_yaml_capped`, which
refuses what would make a small file expensive before `yaml.safe_load` builds anything; `shown`
bounds any value echoed back in an error. A write the file system refuses (full, over quota,
read-only) raises `StorageError`: one line naming the path and what to do. Imports nothing from
launcher but `errors`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import reprlib
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import yaml

from launcher.errors import DlaunchError, StorageError

# A topology or dlaunch.yaml is a few hundred bytes; these bounds are far above any real file and far
# below what makes parsing it slow (a billion-laughs alias chain is a few hundred bytes: 10^9 nodes)
MAX_YAML_BYTES = 1 << 20
MAX_YAML_DEPTH = 20
MAX_YAML_NODES = 20_000  # after alias expansion
MAX_NUMBER_CHARS = 40  # a plain scalar of digits longer than this is not a real setting
SHOWN_CHARS = 80  # the most of a value an error message echoes
_NUMBER_LIKE = re.compile(r"[-+]?[0-9][0-9_,.:]*([eE][-+]?[0-9]+)?")


# what each storage failure means for the user: the file system, not dlaunch, refused the write
_ELSEWHERE = "directory (--run-dir, --sweep-dir, --out)"
_STORAGE_HINTS = {
    errno.ENOSPC: f"no space left on the device: free space there or point dlaunch at another {_ELSEWHERE}",
    errno.EDQUOT: f"disk quota exceeded: free space there or point dlaunch at another {_ELSEWHERE}",
    errno.EROFS: f"the file system is read-only: point dlaunch at a writable {_ELSEWHERE}",
}


@contextlib.contextmanager
def storage(path: str | Path) -> Iterator[None]:
    """Turn a full, over-quota or read-only file system under `path` into a `StorageError`."""
    try:
        yield
    except OSError as e:
        hint = _STORAGE_HINTS.get(e.errno or 0)
        if hint is None:
            raise
        raise StorageError(f"cannot write {shown(str(path), 200)}: {hint}") from e


def atomic_write_text(path: str | Path, text: str, *, fsync: bool = True) -> None:
    """Write `text` to `path` through a 0600 temp file (mkstemp: never world-writable) and a rename.
    `fsync=False` is for files rewritten every second (heartbeats): a crash of the machine may lose
    the last version, but a reader never sees a partial one."""
    p = Path(path)
    with storage(p):
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


def _finite(data: Any) -> Any:
    """`data` with every non-finite float replaced by None (tuples become lists, as in JSON)."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: _finite(v) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [_finite(v) for v in data]
    return data


def json_text(data: Any, *, indent: int | None = 2) -> str:
    """Strict JSON text of `data` (NaN and infinities as null); `indent=None`: one line (a JSON-lines record)."""
    separators = (",", ":") if indent is None else None
    return json.dumps(_finite(data), indent=indent, separators=separators, allow_nan=False)


def atomic_write_json(path: str | Path, data: Any) -> None:
    """`atomic_write_text` of an indented, strict JSON document."""
    atomic_write_text(path, json_text(data) + "\n")


def open_log_stream(path: str | Path) -> IO[str]:
    """Open a console log for line-by-line writing, 0640 whatever the umask: the one file written
    in place, not atomically, as a reader following a live run wants every line as it is printed."""
    with storage(path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
    return open(fd, "w", encoding="utf-8")


def append_lines(path: str | Path, records: Iterable[dict[str, Any]]) -> None:
    """Append strict JSON records, one per line, in a single write so lines never interleave."""
    data = "".join(json_text(r, indent=None) + "\n" for r in records).encode("utf-8")
    if not data:
        return
    with storage(path):
        # O_APPEND makes each write land at the end even with several writers
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            # one write() almost always takes it all; a short write (signal, full disk) must
            # not leave half a line that the next record would be glued to, so finish the job
            while data:
                written = os.write(fd, data)
                data = data[written:]
        finally:
            os.close(fd)


def read_new(path: Path, offsets: dict[Path, int], *, whole_lines: bool) -> str:
    """The text appended to `path` since the last call (`offsets[path]` remembers where it stopped);
    with `whole_lines`, only up to the last newline (`logs --follow`: a half-written line waits)."""
    with open(path, "rb") as f:
        f.seek(offsets.get(path, 0))
        data = f.read()
    end = data.rfind(b"\n") if whole_lines else len(data) - 1
    if end < 0:
        return ""
    offsets[path] = offsets.get(path, 0) + end + 1
    return data[:end + 1].decode("utf-8", errors="replace")


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


def read_json(path: str | Path) -> dict[str, Any]:
    """Parse a JSON file; every one dlaunch writes holds an object (callers still check
    `isinstance(..., dict)` where a hand-edited file could hold something else)."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """`repr(value)` for an error message, at most `limit` characters (reprlib never builds all of a huge one)."""
    short = reprlib.Repr()
    short.maxstring = short.maxother = short.maxlong = limit
    text = short.repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def read_yaml_capped(path: str | Path, *, error: type[DlaunchError] = DlaunchError) -> object:
    """`yaml.safe_load` of a user's YAML file, refusing hostile input before anything is built with one
    `error` line that starts with the path: over MAX_YAML_BYTES, nested deeper than MAX_YAML_DEPTH, over
    MAX_YAML_NODES nodes with aliases expanded, or numbers longer than MAX_NUMBER_CHARS."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_YAML_BYTES:
                raise error(f"{p}: {size / 2**20:.1f} MiB is too large for this file (at most "
                            f"{MAX_YAML_BYTES // 2**20} MiB); is it the right file?")
            raw = f.read(MAX_YAML_BYTES + 1)  # a file growing while read stops here too
    except OSError as e:
        raise error(f"{p}: cannot read: {e.strerror or e}") from None
    if len(raw) > MAX_YAML_BYTES:
        raise error(f"{p}: more than {MAX_YAML_BYTES // 2**20} MiB; is it the right file?")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{p}: not UTF-8 text (byte {e.start}); is it the right file?") from None
    try:
        _check_yaml_shape(text, p, error)
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        if "nesting depth" in str(getattr(e, "problem", "")):
            # libyaml >= 0.2.5 stops deep flow nesting in its scanner, before the shape check
            # sees the events: the same refusal, said the same way
            mark = getattr(e, "problem_mark", None)
            line = f" line {mark.line + 1}:" if mark is not None else ""
            raise error(f"{p}:{line} nested more than {MAX_YAML_DEPTH} levels deep; is it the right file?") from None
        raise error(f"{p}: malformed YAML{_yaml_where(e)} (not valid YAML)") from None
    except (ValueError, RecursionError) as e:  # a value the constructor cannot build
        raise error(f"{p}: a value cannot be read: {shown(str(e))}") from None


def _check_yaml_shape(text: str, path: Path, error: type[DlaunchError]) -> None:
    """Walk the parser's events (flat, nothing built) and refuse depth, size and long numbers. An
    alias counts as the whole node it repeats: the count is the size of what `safe_load` builds."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    size_of: dict[str, int] = {}  # anchor -> expanded nodes under it
    open_nodes: list[tuple[str | None, int]] = []  # (anchor, expanded nodes before it)
    total = 0
    for event in yaml.parse(text, Loader=loader):
        line = event.start_mark.line + 1 if event.start_mark else 0
        if isinstance(event, yaml.AliasEvent):
            total += size_of.get(event.anchor or "", 1)
        elif isinstance(event, yaml.ScalarEvent):
            total += 1
            if event.anchor:
                size_of[event.anchor] = 1
            value = event.value
            if not event.style and len(value) > MAX_NUMBER_CHARS and _NUMBER_LIKE.fullmatch(value):
                raise error(f"{path}: line {line}: a number of {len(value)} characters "
                            f"({shown(value, 24)}); numbers here have at most {MAX_NUMBER_CHARS}")
        elif isinstance(event, yaml.CollectionStartEvent):
            total += 1
            open_nodes.append((event.anchor, total))
            if len(open_nodes) > MAX_YAML_DEPTH:
                raise error(f"{path}: line {line}: nested more than {MAX_YAML_DEPTH} levels "
                            "deep; is it the right file?")
        elif isinstance(event, yaml.CollectionEndEvent) and open_nodes:
            anchor, before = open_nodes.pop()
            if anchor:
                size_of[anchor] = total - before + 1
        if total > MAX_YAML_NODES:
            raise error(f"{path}: line {line}: more than {MAX_YAML_NODES} values (aliases "
                        "expanded); a file this large is not a setting")


def _yaml_where(exc: yaml.YAMLError) -> str:
    """` at line L, column C: problem` of a YAML error (one line, bounded)."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = (getattr(exc, "problem", None) or (str(exc).splitlines() or [type(exc).__name__])[0])[:SHOWN_CHARS]
    if mark is None:
        return f": {problem}"
    return f" at line {mark.line + 1}, column {mark.column + 1}: {problem}"

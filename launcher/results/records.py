"""Reading a run directory without trusting it: the launch spec, each rank's records and
summary, which ranks are there, and whether the dlaunch that owns the directory still lives.

A run directory is read after the fact (`dlaunch report`), possibly after a crash, a hand edit
or another run writing into it. So: a record of the wrong shape is skipped and counted (the note
names the file and line); records of another run (another `run_id`) are ignored and counted;
the ranks read are the rank files present, capped by the launch spec's world size, never a loop
over a count a file claims; a launch.json that is not a launch spec is one `RunDirError` line.

Never imports report, jobs, backends, cli or runtime.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from itertools import islice
from pathlib import Path
from typing import Any

from launcher.errors import DlaunchError, RunDirError
from launcher.files import read_json, read_jsonl
from launcher.knobs import migrate
from launcher.procs import pid_alive
from launcher.results.schema import dataclass_problem, is_number, kind_of, type_problem
from launcher.rundir import RECORDS, SUMMARY, RunPaths
from launcher.runspec import LaunchSpec

# missing ranks listed one by one (a rank result each); beyond it they are only counted
MISSING_LISTED = 16
# bad lines named in a note; beyond it they are only counted
LINES_NAMED = 3

_NUM = float | None
# per record kind: the keys a reader uses and their types (other keys are left alone)
_COMMON: dict[str, Any] = {"kind": str, "time": float, "run_id": str, "host_load": dict[str, _NUM]}
_KINDS: dict[str, dict[str, Any]] = {
    "start": {"rank": int, "node_rank": int, "local_rank": int, "host": str, "attempt": int, "sample_units": str},
    "step": {"step": int, "step_time_s": float, "samples": float, "units": float, "data_wait_s": float,
             "end_time": float, "loss": _NUM, "peak_mem_bytes": int | None, "live_peak_bytes": int | None,
             "warmup": bool, "profiled": bool, "skipped": bool},
    "resume": {"step": int}, "workload": {"sample_units": str},
    "comm": {"exposed_comm_s": _NUM, "busbw_gb_s": _NUM, "nosync_step_s": _NUM, "tp_comm_s": _NUM},
    "compile": {"graphs": int | None, "graph_breaks": int | None, "recompiles": int | None, "fallback": str | None},
    "profile": {"trace": str | None, "top_ops": list[dict[str, Any]], "device_time_s": _NUM},
}
_REQUIRED = {"step": ("step", "step_time_s", "samples", "units", "data_wait_s"), "resume": ("step",)}
_SUMMARY: dict[str, Any] = {"status": str, "error": str | None, "time": float, "eval": dict | None,
                            "preempted_by": str, "checkpoint_step": int, "rank_error": str | None, "steps": int}


def read_spec(run_dir: str | Path) -> LaunchSpec:
    """The run's launch spec; one-line RunDirError when launch.json is unreadable or is not a
    launch spec (wrong JSON type, unknown or missing keys, values of the wrong type)."""
    path = RunPaths(root=run_dir).launch
    try:
        data = read_json(path)
    except (OSError, ValueError) as e:
        raise RunDirError(f"{path}: unreadable ({type(e).__name__}: {e})") from None
    data = migrate(data) if isinstance(data, dict) else data  # written by an earlier version
    if (problem := dataclass_problem(LaunchSpec, data)) is None:
        try:
            return LaunchSpec.from_dict(data)
        except DlaunchError as e:
            problem = str(e)
        except (TypeError, ValueError) as e:
            problem = f"{type(e).__name__}: {e}"
    raise RunDirError(f"{path} is not a launch spec (expected an object with the keys `dlaunch run` writes: {problem})")


def read_plan_json(run_dir: str | Path) -> tuple[dict[str, Any] | None, str | None]:
    """(plan.json, None): the plan the run followed (None without one); (None, why) when it is unusable."""
    path = RunPaths(root=run_dir).plan
    if not path.is_file():
        return None, None
    try:
        plan = read_json(path)
    except (OSError, ValueError) as e:
        return None, f"{path.name}: unreadable ({e})"
    return (plan, None) if isinstance(plan, dict) else (None, f"{path.name}: not a JSON object")


def record_problem(rec: Any) -> str | None:
    """Why `rec` is not a record of the shape the ranks write; None when it is."""
    if not isinstance(rec, dict):
        return f"{kind_of(rec)}, not a record"
    if not isinstance(rec.get("kind"), str):
        return "no `kind`"
    schema = _KINDS.get(rec["kind"], {})
    for key in _REQUIRED.get(rec["kind"], ()):
        if key not in rec:
            return f"{rec['kind']} record without {key!r}"
    for key, hint in (*_COMMON.items(), *schema.items()):
        if key in rec and (p := type_problem(rec[key], hint)) is not None:
            return f"{rec['kind']} record: {key!r} {p}"
    if rec["kind"] == "step" and rec["step_time_s"] < 0:
        return "step record: negative 'step_time_s'"
    return None


def read_records(path: Path, run_id: str | None) -> tuple[list[dict[str, Any]], list[str]]:
    """The well-formed records of this run in one rank file, and notes on what was left out. A
    record of another run names another `run_id`, or follows a start record naming one (until a
    start record of this run); `run_id` None keeps every run's."""
    raw, cut = read_jsonl(path)
    notes = [cut] if cut else []
    kept: list[dict[str, Any]] = []
    bad: list[str] = []
    foreign: dict[str, int] = {}
    theirs: str | None = None  # the run id of the last start record, when not this run's
    for n, rec in enumerate(raw, 1):  # read_jsonl keeps one entry per line, in order
        if (problem := record_problem(rec)) is not None:
            bad.append(f"line {n}: {problem}")
            continue
        rid = rec.get("run_id")
        alien = rid if run_id is not None and rid is not None and rid != run_id else None
        if rec["kind"] == "start":
            theirs = alien
        if (other := theirs or alien) is not None:
            foreign[other] = foreign.get(other, 0) + 1
        else:
            kept.append(rec)
    if bad:
        named = "; ".join(bad[:LINES_NAMED]) + ("; ..." if len(bad) > LINES_NAMED else "")
        notes.append(f"{path.name}: {len(bad)} malformed record(s) skipped ({named})")
    if foreign:
        notes.append(f"{path.name}: ignored {sum(foreign.values())} record(s) of another run "
                     f"({', '.join(sorted(foreign)[:LINES_NAMED])})")
    return kept, notes


def read_summary(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """A rank's summary, or (None, why) when it cannot be used."""
    try:
        data = read_json(path)
    except (OSError, ValueError) as e:
        return None, f"{path.name}: not valid JSON ({e})"
    if not isinstance(data, dict) or not isinstance(data.get("status"), str):
        return None, f"{path.name}: not a rank summary (expected an object with a `status`); ignored"
    for key, hint in _SUMMARY.items():
        if key in data and (p := type_problem(data[key], hint)) is not None:
            return None, f"{path.name}: not a rank summary ({key!r} {p}); ignored"
    return data, None


def rank_numbers(run_dir: str | Path, world_size: int) -> tuple[list[int], list[int], int]:
    """(ranks with a rank file below `world_size`, the first MISSING_LISTED missing ranks, how
    many more are missing): a launch.json claiming 10^9 ranks costs what its files cost."""
    paths = RunPaths(root=run_dir)
    present = sorted({r for suffix in (RECORDS, SUMMARY) for r in paths.rank_files(suffix) if r < world_size})
    have = set(present)
    listed = list(islice((r for r in range(world_size) if r not in have), MISSING_LISTED))
    return present, listed, world_size - len(present) - len(listed)


def owner_state(run_dir: str | Path) -> str | None:
    """"running" when a process of the dlaunch that owns the run dir (it, or its torchrun) still
    lives, "orphaned" when all are gone; None when the owner file does not say (no file, another
    host, no pid). A pid counts only if its process started before the owner file named it: a
    recycled pid is never taken for the run's."""
    try:
        owner = read_json(RunPaths(root=run_dir).owner)
    except (OSError, ValueError):
        return None
    if not isinstance(owner, dict) or owner.get("host") != socket.gethostname():
        return None
    pids = [(owner.get(key), owner.get(when)) for key, when in (("pid", "time"), ("torchrun_pid", "torchrun_started"))]
    named = [(p, float(t) if isinstance(t, (int, float)) and is_number(t) else None) for p, t in pids
             if isinstance(p, int) and not isinstance(p, bool) and p > 0]
    return ("running" if any(pid_alive(p, not_after=t) for p, t in named) else "orphaned") if named else None


def read_ranks(run_dir: Path, ranks: Sequence[int], run_id: str | None) -> tuple[
        dict[int, list[dict[str, Any]]], dict[int, dict[str, Any]], list[str]]:
    """Records (this run's, well-formed) and summaries of `ranks`, and notes on what was left out."""
    records: dict[int, list[dict[str, Any]]] = {}
    summaries: dict[int, dict[str, Any]] = {}
    notes: list[str] = []
    paths = RunPaths(root=run_dir)
    for rank in ranks:
        if (path := paths.records(rank)).exists():
            records[rank], more = read_records(path, run_id)
            notes += more
        if (spath := paths.summary(rank)).exists():
            summary, note = read_summary(spath)
            if summary is not None:
                summaries[rank] = summary
            if note:
                notes.append(note)
    return records, summaries, notes


def missing_note(world_size: int, present: int, unlisted: int) -> str | None:
    """The line for ranks counted but not listed (a launch spec claiming more ranks than wrote)."""
    return (f"{unlisted:,} more of the {world_size:,} ranks launch.json names wrote no rank file "
            f"({present:,} did)") if unlisted > 0 else None

"""Finding and reading the runs a report covers: a sweep, one run, a tune's trials (its
tune.json read by `report.tune`), or a directory of runs.

Reading is built for thousands of ranks: `result.json` is trusted while no rank file is newer
than it (otherwise the run is aggregated again, so a rank file cut after the run is noticed),
and the per-step times come from one regular-expression pass per rank file, falling back to
parsing each line as JSON when a file does not have the harness's record layout.

Never imports cli, backends or runtime, and writes nothing into a run directory.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.errors import DlaunchError, RunDirError
from launcher.files import read_json
from launcher.hardware.topology import topology_from_dict
from launcher.hardware.types import Topology
from launcher.knobs import migrate
from launcher.report.tune import read_tune
from launcher.report.types import TuneSummary
from launcher.results.aggregate import aggregate, percentile
from launcher.results.records import missing_note, rank_numbers, read_plan_json, read_records, read_spec, record_problem
from launcher.results.schema import kind_of
from launcher.results.types import RunResult
from launcher.rundir import RECORDS, RunPaths, SweepPaths, TunePaths
from launcher.runspec import LaunchSpec
from launcher.sweepmanifest import read_manifest

log = logging.getLogger(__name__)

# at most this many boxes in a per-rank plot: beyond it ranks are grouped (per node, or blocks)
GROUP_LIMIT = 64
# the harness writes "warmup" right before "step_time_s" (runtime/harness.py); files written
# another way (the plain-script meter) take the line-by-line JSON path
_STEP = re.compile(rb'"warmup":(t|f)[a-z]*,"step_time_s":(-?[0-9.]+(?:[eE][-+]?[0-9]+)?)')
_RESULT_FIELDS = {f.name for f in dataclasses.fields(RunResult)}


@dataclass(kw_only=True)
class RunData:
    """One run directory, read: its spec, its aggregate, and every rank's steady steps."""

    run_dir: Path
    spec: LaunchSpec | None
    result: RunResult | None
    step_times: dict[int, list[float]] = field(default_factory=dict)  # steady steps, seconds
    comm: dict[int, dict[str, Any]] = field(default_factory=dict)  # the calibration record
    plan: dict[str, Any] | None = None  # plan.json: the plan `dlaunch run` followed, if any
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class Entry:
    """A run the report covers, with its place in the sweep."""

    name: str
    world_size: int
    repeat: int
    run_dir: Path
    status: str | None = None  # from the manifest
    error: str | None = None


@dataclass(kw_only=True)
class Target:
    """What a report directory holds."""

    kind: str  # sweep | run | runs | tune
    entries: list[Entry]
    mode: str | None = None
    topology: Topology | None = None
    notes: list[str] = field(default_factory=list)
    tune: TuneSummary | None = None  # kind "tune"


def _is_run(d: Path) -> bool:
    paths = RunPaths(root=d)
    return paths.launch.is_file() or paths.result.is_file()


def _workload(d: Path) -> tuple[str, ...]:
    """What the run ran: its workload file and arguments, from launch.json (() when unread)."""
    try:
        data = read_json(RunPaths(root=d).launch)
    except (OSError, ValueError):
        return ()
    return (str(data.get("workload", "")), *map(str, data.get("workload_args") or ())) if isinstance(data, dict) else ()


def _world_size(d: Path) -> int:
    """The world size the run's files say (1 when none says it; read_run checks the files)."""
    paths = RunPaths(root=d)
    for path, keys in ((paths.launch, ("nodes", "gpus")), (paths.result, ("world_size",))):
        try:
            data = read_json(path)
        except (OSError, ValueError):
            continue
        data = migrate(data) if isinstance(data, dict) and path == paths.launch else data
        values = [data.get(k, 1) if isinstance(data, dict) else None for k in keys]
        if all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values):
            return math.prod(values)
    return 1


def discover(path: Path) -> Target:
    """Classify `path`; one-line DlaunchError when it does not exist or holds no run."""
    if not path.exists():
        raise DlaunchError(f"{path} does not exist; give a run or sweep directory (runs/<id>)")
    if not path.is_dir():
        raise DlaunchError(f"{path} is not a directory; give a run, sweep or tune directory")
    if SweepPaths(root=path).manifest.is_file():
        manifest = read_manifest(path)
        entries = [Entry(name=p.name, world_size=int(p.world_size), repeat=int(p.repeat),
                         run_dir=path / p.name, status=p.status, error=p.error)
                   for p in (manifest.points if manifest is not None else ())]
        if not entries:
            raise DlaunchError(f"no runs in {path}: the sweep has no points yet")
        notes = [f"{e.name}: {e.status}" + (f" ({e.error})" if e.error else "")
                 for e in entries if e.status not in ("ok", "failed")]
        assert manifest is not None  # narrowing: the sweep has points
        return Target(kind="sweep", entries=entries, mode=manifest.mode,
                      topology=_topology(manifest.topology), notes=notes)
    if _is_run(path):
        return Target(kind="run", entries=[Entry(name=path.name, world_size=_world_size(path), repeat=0, run_dir=path)])
    unread: list[str] = []  # a tune.json that is not one: its trials are reported as runs
    if TunePaths(root=path).record.is_file():
        tune, unread = read_tune(path)
        if tune is not None:
            return Target(kind="tune", tune=tune, notes=unread, entries=[
                Entry(name=t.run_name, world_size=tune.world_size, repeat=0, run_dir=path / t.run_name,
                      status=t.status, error=t.reason or None) for t in tune.trials])
    runs = sorted(d for d in path.iterdir() if d.is_dir() and _is_run(d))
    if not runs:
        raise DlaunchError(f"no runs in {path}: expected a sweep (sweep.json), a run "
                           "(launch.json / result.json), a tune (tune.json) or directories of runs")
    ran = {d: _workload(d) for d in runs}
    if len(set(ran.values())) > 1:  # a curve compares runs of one workload: the newest run's, the rest named
        newest = ran[max((d for d in runs if ran[d]) or runs, key=lambda d: max(
            f.stat().st_mtime for f in (RunPaths(root=d).launch, RunPaths(root=d).result) if f.is_file()))]
        named = {w: " ".join([Path(w[0]).name, *w[1:]]) if w else "unknown (launch.json unread)" for w in ran.values()}
        others = Counter(named[w] for w in ran.values() if w != newest)
        runs = [d for d in runs if ran[d] == newest]
        unread.append(f"left out {sum(others.values())} run(s) of other workloads ("
                      f"{', '.join(f'{w}: {k}' for w, k in others.items())}): the curve is the newest run's "
                      f"workload's ({named[newest]}); report a directory of the others' runs for theirs")
    seen: dict[int, int] = {}
    entries = []
    for d in runs:
        n = _world_size(d)
        entries.append(Entry(name=d.name, world_size=n, repeat=seen.get(n, 0), run_dir=d))
        seen[n] = seen.get(n, 0) + 1
    return Target(kind="runs", entries=sorted(entries, key=lambda e: (e.world_size, e.repeat)), notes=unread)


def _topology(data: Any) -> Topology | None:
    if not data:
        return None
    try:
        return topology_from_dict(data, origin="sweep.json")
    except Exception as e:  # an unreadable topology only costs the link column
        log.warning("sweep.json: topology unreadable (%s)", e)
        return None


def _read_result(run_dir: Path) -> tuple[RunResult | None, list[str]]:
    """result.json when it is newer than every rank file, else a fresh aggregate."""
    paths = RunPaths(root=run_dir)
    path, raw = paths.result, None
    notes: list[str] = []
    if path.is_file():
        try:
            raw = read_json(path)
        except (OSError, ValueError) as e:
            notes.append(f"{path.name}: unreadable ({e}); aggregated the rank files again")
        if raw is not None and not isinstance(raw, dict):
            notes.append(f"{path.name}: not a dlaunch result (expected an object, got "
                         f"{kind_of(raw)}); aggregated the rank files again")
            raw = None
    fresh = None
    if raw is not None:
        try:
            fresh = RunResult.from_dict({k: v for k, v in raw.items() if k in _RESULT_FIELDS})
        except (TypeError, ValueError, KeyError) as e:
            notes.append(f"{path.name}: not a dlaunch result ({e}); aggregated the rank files")
    if fresh is not None:
        newest = path.stat().st_mtime
        if not any(p.stat().st_mtime > newest for p in paths.rank_files(RECORDS).values()):
            return fresh, notes
    if paths.launch.is_file():
        try:
            return aggregate(run_dir), notes
        except (OSError, ValueError, TypeError, KeyError, DlaunchError) as e:
            notes.append(f"{run_dir.name}: cannot aggregate the rank files again "
                         f"({type(e).__name__}: {e})"
                         + ("; showing result.json as written at the end of the run" if fresh is not None else ""))
    return fresh, notes


def _parse_rank_file(path: Path, run_id: str | None) -> tuple[list[float], dict[str, Any] | None, list[str]]:
    """Steady step times, the comm record, and notes on what was left out."""
    raw = path.read_bytes()
    if run_id is not None and raw.count(b'"run_id":') != raw.count(b'"run_id":' + json.dumps(run_id).encode()):
        return _parse_slow(path, run_id)  # records of another run to leave out
    note = None
    if raw and not raw.endswith(b"\n"):
        n = raw.count(b"\n") + 1
        note = f"{path.name}: last line {n} is cut off (rank killed mid-write?); ignored"
        raw = raw[:raw.rfind(b"\n") + 1]
    comm = None
    i = raw.find(b'{"kind":"comm"')
    if i >= 0:
        try:
            comm = json.loads(raw[i:raw.index(b"\n", i)])
        except ValueError:
            comm = None
        if record_problem(comm) is not None:
            return _parse_slow(path, run_id)
    lines = raw.count(b"\n")
    wellformed = lines == 0 or (raw.startswith(b'{"kind":') and raw.count(b'\n{"kind":') == lines - 1)
    matches = _STEP.findall(raw) if wellformed else []
    # every step record has exactly one "step_time_s" key, whatever its layout
    if wellformed and len(matches) == raw.count(b'"step_time_s"'):
        # every step was warm-up: use them all, as aggregate does
        times = [float(t) for w, t in matches if w == b"f"] or [float(t) for _, t in matches]
        return times, comm, [note] if note else []
    return _parse_slow(path, run_id)


def _parse_slow(path: Path, run_id: str | None) -> tuple[list[float], dict[str, Any] | None, list[str]]:
    """Record by record (results.records: well-formed records of this run only)."""
    records, notes = read_records(path, run_id)
    steps = [r for r in records if r["kind"] == "step"]
    comm = next((r for r in reversed(records) if r["kind"] == "comm"), None)
    steady = [r for r in steps if not r.get("warmup")] or steps
    return [float(r["step_time_s"]) for r in steady], comm, notes


def read_run(run_dir: Path) -> RunData:
    """Read one run directory (never raises for unreadable files: it notes them)."""
    spec, notes = None, []
    paths = RunPaths(root=run_dir)
    if paths.launch.is_file():
        try:
            spec = read_spec(run_dir)
        except RunDirError as e:
            notes.append(str(e))
    result, more = _read_result(run_dir)
    plan, unusable = read_plan_json(run_dir)
    notes += [*more, *([unusable] if unusable else [])]
    data = RunData(run_dir=run_dir, spec=spec, result=result, plan=plan, notes=notes)
    world = spec.world_size if spec else (result.world_size if result else 0)
    have, missing, unlisted = rank_numbers(run_dir, world)
    files = paths.rank_files(RECORDS)
    for rank in sorted([*missing, *(r for r in have if r not in files)]):
        notes.append(f"{paths.records(rank).name}: missing (rank {rank} never started or wrote nothing)")
    if (line := missing_note(world, len(have), unlisted)) is not None:
        notes.append(line)
    for rank in (r for r in have if r in files):
        data.step_times[rank], comm, more = _parse_rank_file(paths.records(rank), spec.run_id if spec else None)
        if comm:
            data.comm[rank] = comm
        notes += more
    return data


def _stats(values: list[float]) -> dict[str, float]:
    xs = sorted(values)
    return {"p5": percentile(xs, 5), "p25": percentile(xs, 25), "p50": percentile(xs, 50),
            "p75": percentile(xs, 75), "p95": percentile(xs, 95), "min": xs[0], "max": xs[-1],
            "mean": sum(xs) / len(xs), "n": len(xs)}


def group_distributions(data: RunData, result: RunResult, slow: set[int] | None = None,
                        limit: int = GROUP_LIMIT) -> dict[str, Any]:
    """Step-time distributions for box plots: one per rank up to `limit` ranks, else one per node
    (when the nodes are few enough), else contiguous blocks of ranks. Each group keeps its slowest
    rank median, so a straggler stays visible in an aggregated plot."""
    ranks = {r.rank: r for r in result.ranks}
    slow = set(result.stragglers) if slow is None else slow
    present = [r for r in sorted(data.step_times) if data.step_times[r]]
    if not present:
        return {"grouping": "none", "groups": [], "caption": "no steady steps recorded"}
    if len(present) <= limit:
        grouping, groups = "rank", [(f"{r}", [r]) for r in present]
    else:
        nodes: dict[int, list[int]] = {}
        for r in present:
            nodes.setdefault(ranks[r].node_rank if r in ranks else 0, []).append(r)
        if 1 < len(nodes) <= limit:
            grouping, groups = "node", [(f"n{n}", rs) for n, rs in sorted(nodes.items())]
        else:
            grouping = "rank block"
            size = -(-len(present) // (limit // 2))
            groups = [(f"{present[i]}-{present[min(i + size, len(present)) - 1]}",
                       present[i:i + size]) for i in range(0, len(present), size)]
    out = []
    for label, members in groups:
        values = [t for r in members for t in data.step_times[r]]
        worst = max(members, key=lambda r: ranks[r].step_time_median_s if r in ranks else 0.0)
        out.append({"label": label, "ranks": len(members), **_stats(values),
                    "straggler": any(r in slow for r in members), "worst_rank": worst,
                    "worst_rank_median_s": ranks[worst].step_time_median_s if worst in ranks else None})
    caption = {"rank": "one box per rank",
               "node": f"{len(present)} ranks grouped per node",
               "rank block": f"{len(present)} ranks grouped in blocks of {len(groups[0][1])}"}[grouping]
    return {"grouping": grouping, "groups": out, "caption": caption + "; boxes p25-p75, whiskers p5-p95, line median"}

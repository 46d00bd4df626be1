"""`dlaunch doctor`'s verdicts: the ranks' measurements against each other and the expectation.

Reads what each doctor rank wrote (`rank-<r>.summary.json`, its `doctor` part: see
launcher.runtime.doctor_rank), then judges (`judge`):

  - per rank, the GEMM and copy rates; per node, the all-reduce busbw between its ranks: each
    against the median of the same check over every rank (node). Below `threshold` x that
    median (default 0.8, the issue's rule) it is SLOW, and so is its node.
  - each number is also set against its expectation (launcher.plan.expected) as a share of it;
    that share alone never makes a rank SLOW (every rank of a uniformly slow machine, or a
    wrong expectation, would), but a median below `threshold` x the expectation is noted.
  - a rank that left no measurement failed; its node counts as bad too, unless it was only
    stopped because another rank failed (status `stopped`: torchrun's SIGTERM after a peer died).

The bad nodes' host names are the ready `--exclude` value of a SLURM job. `DoctorReport.to_dict`
is the JSON; results.doctor_view prints the terminal table. Pure: reads JSON files only, no torch; never
imports cli, backends, jobs, runtime or report.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.files import read_json, read_jsonl
from launcher.plan.expected import Expectations, Expected
from launcher.rundir import RunPaths

DEFAULT_THRESHOLD = 0.8
RANK_CHECKS = ("gemm", "copy")
CHECK_NAMES = {"gemm": "GEMM", "copy": "copy", "allreduce_node": "all-reduce within the node",
               "allreduce_world": "all-reduce across nodes"}


@dataclass(frozen=True, kw_only=True)
class RankReading:
    """What one rank measured (rates in FLOP/s and bytes/s), or why it measured nothing."""

    rank: int
    host: str = "?"
    node: int = 0
    local_rank: int = 0
    device: str = "cpu"
    device_name: str = ""
    precision: str = ""
    threads: int = 1
    gemm: float | None = None
    gemm_n: int = 0
    copy: float | None = None
    copy_bytes: int = 0  # read + written per repetition
    allreduce_node: float | None = None  # busbw between the node's ranks
    node_ranks: int = 1
    allreduce_world: float | None = None  # busbw between every rank (several nodes)
    world_size: int = 1
    allreduce_bytes: int = 0
    slowed: bool = False  # the test hook slowed this rank (DLAUNCH_DOCTOR_SLOW_RANK)
    error: str = ""  # why there is no measurement ("" when there is one)
    status: str = "ok"  # how the rank ended (its summary's: failed, killed, hung, stopped...)

    @property
    def collateral(self) -> bool:
        """Stopped because another rank failed: says nothing against its own node."""
        return self.status == "stopped"

    @property
    def label(self) -> str:
        """`cuda:<local rank>` or `cpu`."""
        return f"cuda:{self.local_rank}" if self.device == "cuda" else "cpu"


def _rate(check: Any, key: str = "rate") -> float | None:
    if isinstance(check, Mapping) and isinstance(check.get(key), int | float) and check[key] > 0:
        return float(check[key])
    return None


def reading_from_summary(rank: int, summary: Mapping[str, Any]) -> RankReading:
    """A rank's summary -> its reading (an `error` one when it has no measurement)."""
    doc = summary.get("doctor")
    if summary.get("status") != "ok" or not isinstance(doc, Mapping):
        status = str(summary.get("status") or "failed")
        why = str(summary.get("error") or f"ended {status}")
        return RankReading(rank=rank, host=str(summary.get("host") or "?"), error=why,
                           status="failed" if status == "ok" else status)
    ar_node, ar_world = doc.get("allreduce_node"), doc.get("allreduce_world")
    gemm, copy = doc.get("gemm") or {}, doc.get("copy") or {}
    return RankReading(
        rank=rank, host=str(doc.get("host", "?")), node=int(doc.get("node_rank", 0)),
        local_rank=int(doc.get("local_rank", 0)), device=str(doc.get("device", "cpu")),
        device_name=str(doc.get("device_name", "")), precision=str(doc.get("precision", "")),
        threads=int(doc.get("threads", 1)), gemm=_rate(gemm), gemm_n=int(gemm.get("n", 0)),
        copy=_rate(copy), copy_bytes=int(copy.get("bytes", 0)), allreduce_node=_rate(ar_node, "busbw"),
        node_ranks=int(doc.get("local_world_size", 1)), allreduce_world=_rate(ar_world, "busbw"),
        world_size=int(doc.get("world_size", 1)), allreduce_bytes=int((ar_node or ar_world or {}).get("bytes", 0)),
        slowed=bool(doc.get("slowed")))


def _where(paths: RunPaths, rank: int) -> dict[str, Any]:
    """A failed rank's host, node, local rank and device from its start record ({} if it never started)."""
    try:
        records, _ = read_jsonl(paths.records(rank))
    except (OSError, ValueError):
        return {}
    if (start := next((r for r in records if r.get("kind") == "start"), None)) is None:
        return {}
    return {"host": str(start.get("host", "?")), "node": int(start.get("node_rank", 0)),
            "local_rank": int(start.get("local_rank", 0)), "device": str(start.get("device", "cpu"))}


def read_readings(run_dir: str | Path, world_size: int) -> list[RankReading]:
    """Every rank's reading from the run dir; a rank without a summary failed to report."""
    paths = RunPaths(root=Path(run_dir))
    out = []
    for rank in range(world_size):
        try:
            reading = reading_from_summary(rank, read_json(paths.summary(rank)))
        except FileNotFoundError:
            reading = RankReading(rank=rank, error="left no result (see its log under logs/)", status="failed")
        except (OSError, ValueError) as e:
            reading = RankReading(rank=rank, error=f"unreadable result: {e}", status="failed")
        if reading.error:
            reading = dataclasses.replace(reading, **_where(paths, rank))
        out.append(reading)
    return out


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """One measured number: against the median of its peers and its expectation."""

    check: str
    measured: float
    median: float
    expected: Expected | None
    slow: bool

    @property
    def of_median(self) -> float:
        return self.measured / self.median if self.median > 0 else 1.0

    @property
    def of_expected(self) -> float | None:
        return self.measured / self.expected.value if self.expected and self.expected.value > 0 else None

    def to_dict(self) -> dict[str, Any]:
        return {"measured": self.measured, "median": self.median, "of_median": self.of_median,
                "expected": self.expected.value if self.expected else None,
                "of_expected": self.of_expected, "slow": self.slow}


@dataclass(frozen=True, kw_only=True)
class RankRow:
    """A rank that measured, and its two verdicts."""

    reading: RankReading
    verdicts: tuple[Verdict, ...]

    @property
    def slow(self) -> bool:
        """Any check below the threshold of the median."""
        return any(v.slow for v in self.verdicts)


@dataclass(frozen=True, kw_only=True)
class NodeRow:
    """A node: its ranks, the all-reduce between them, and whether it is bad."""

    node: int
    host: str
    ranks: tuple[int, ...]
    allreduce: Verdict | None
    slow_ranks: tuple[int, ...] = ()
    failed_ranks: tuple[int, ...] = ()

    @property
    def bad(self) -> bool:
        """A slow or failed rank, or a slow all-reduce."""
        return bool(self.slow_ranks or self.failed_ranks or (self.allreduce and self.allreduce.slow))


@dataclass(frozen=True, kw_only=True)
class DoctorReport:
    """The whole verdict of one doctor run."""

    device: str
    precision: str
    threshold: float
    expectations: Expectations
    ranks: tuple[RankRow, ...]
    nodes: tuple[NodeRow, ...]
    world: Verdict | None
    failed: tuple[RankReading, ...] = ()
    notes: tuple[str, ...] = ()
    slurm: bool = False
    run_dir: str = ""
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        """No rank failed and none (no node) is SLOW."""
        return not self.failed and not any(n.bad for n in self.nodes)

    @property
    def exclude(self) -> tuple[str, ...]:
        """The bad nodes' hosts, sorted: a SLURM job's `--exclude` list (none on this host: its ranks are named)."""
        return tuple(sorted({n.host for n in self.nodes if n.bad})) if self.slurm else ()

    def to_dict(self) -> dict[str, Any]:
        exp = self.expectations
        return {
            "ok": self.ok, "device": self.device, "precision": self.precision,
            "threshold": self.threshold, "expected_from": exp.basis,
            "expected": {k: None if e is None else {"value": e.value, "peak": e.peak, "fraction": e.fraction,
                                                    "source": e.source} for k, e in exp.checks.items()},
            "expected_missing": dict(exp.missing),
            "ranks": [{"rank": r.reading.rank, "node": r.reading.node, "host": r.reading.host,
                       "local_rank": r.reading.local_rank, "device": r.reading.label,
                       "device_name": r.reading.device_name, "threads": r.reading.threads,
                       "slow": r.slow, "slowed_by_test_hook": r.reading.slowed,
                       **{v.check: v.to_dict() for v in r.verdicts}} for r in self.ranks],
            "nodes": [{"node": n.node, "host": n.host, "ranks": list(n.ranks), "bad": n.bad,
                       "slow_ranks": list(n.slow_ranks), "failed_ranks": list(n.failed_ranks),
                       "allreduce": n.allreduce.to_dict() if n.allreduce else None} for n in self.nodes],
            "allreduce_world": self.world.to_dict() if self.world else None,
            "failed": [{"rank": f.rank, "host": f.host, "node": f.node, "status": f.status, "error": f.error}
                       for f in self.failed],
            "slow_ranks": [r.reading.rank for r in self.ranks if r.slow], "exclude": ",".join(self.exclude) or None,
            "notes": list(self.notes), "run_dir": self.run_dir, "wall_s": self.wall_s,
        }


def rate_unit(check: str, device: str = "") -> str:
    """The unit a check's rate is printed in."""
    return ("TFLOP/s" if device == "cuda" else "GFLOP/s") if check == "gemm" else "GB/s"


def fmt_rate(check: str, value: float, device: str = "") -> str:
    """A check's rate in its unit, 3 significant figures at most."""
    x = value / (1e12 if check == "gemm" and device == "cuda" else 1e9)
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


def _verdicts(values: Mapping[int, float], check: str, expected: Expected | None,
              threshold: float) -> dict[int, Verdict]:
    """key -> Verdict of each value against the median of all of them."""
    median = _median(list(values.values()))
    return {k: Verdict(check=check, measured=v, median=median, expected=expected,
                       slow=v < threshold * median) for k, v in values.items()}


def _low_note(check: str, median: float, expected: Expected | None, threshold: float,
              what: str, device: str) -> str | None:
    if expected is None or expected.value <= 0 or median <= 0 or median >= threshold * expected.value:
        return None  # nothing expected, nothing measured, or within the threshold
    return (f"note: {what} {CHECK_NAMES[check]} is {median / expected.value:.0%} of the expected "
            f"{fmt_rate(check, expected.value, device)} {rate_unit(check, device)}: every rank is slow alike "
            "(a busy host, clocks, a wrong --topology), or the expectation does not describe this "
            "hardware")


def judge(readings: Sequence[RankReading], expectations: Expectations, *, threshold: float = DEFAULT_THRESHOLD,
          slurm: bool = False, run_dir: str = "", wall_s: float = 0.0) -> DoctorReport:
    """Every rank's and node's verdict (see the module docstring)."""
    good = [r for r in readings if not r.error]
    failed = tuple(r for r in readings if r.error)
    device = good[0].device if good else "?"
    exp = expectations.checks
    per_check: dict[str, dict[int, Verdict]] = {}
    notes: list[str | None] = []  # the low notes of each check, None where none is due
    for check in RANK_CHECKS:
        values = {r.rank: v for r in good if (v := getattr(r, check)) is not None}
        per_check[check] = _verdicts(values, check, exp.get(check), threshold)
        notes.append(_low_note(check, _median(list(values.values())), exp.get(check), threshold,
                               "the median rank's", device))
    rows = tuple(RankRow(reading=r, verdicts=tuple(per_check[c][r.rank] for c in RANK_CHECKS if r.rank in per_check[c]))
                 for r in good)
    # nodes: by node id (SLURM's under SLURM), named by the host of their ranks
    node_ids = sorted({r.node for r in good} | {r.node for r in failed if r.host != "?"})
    hosts = {r.node: r.host for r in readings if r.host != "?"}
    # every rank of a node timed the same collective
    node_bw = {node: _median(seen) for node in node_ids
               if (seen := [r.allreduce_node for r in good if r.node == node and r.allreduce_node is not None])}
    node_verdicts = _verdicts(node_bw, "allreduce_node", exp.get("allreduce_node"), threshold)
    notes.append(_low_note("allreduce_node", _median(list(node_bw.values())),
                           exp.get("allreduce_node"), threshold, "the median node's", device))
    slow = {r.reading.rank for r in rows if r.slow}
    nodes = tuple(NodeRow(
        node=node, host=hosts.get(node, "?"), ranks=tuple(r.rank for r in good if r.node == node),
        allreduce=node_verdicts.get(node),
        slow_ranks=tuple(sorted(r.rank for r in good if r.node == node and r.rank in slow)),
        failed_ranks=tuple(r.rank for r in failed if r.node == node and r.host != "?" and not r.collateral))
        for node in node_ids)
    world = None
    if world_values := [r.allreduce_world for r in good if r.allreduce_world is not None]:
        median, expected = _median(world_values), exp.get("allreduce_world")
        world = Verdict(check="allreduce_world", measured=median, median=median, expected=expected, slow=False)
        notes.append(_low_note("allreduce_world", median, expected, threshold, "the", device))
    return DoctorReport(device=device, precision=good[0].precision if good else "?", threshold=threshold,
                        expectations=expectations, ranks=rows, nodes=nodes, world=world, failed=failed,
                        notes=tuple(n for n in notes if n), slurm=slurm, run_dir=run_dir, wall_s=wall_s)

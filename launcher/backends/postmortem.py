"""After a job ended badly: find out how each rank ended and leave it in the run dir.

A rank that raises writes its own summary. A rank that was SIGKILLed, exited early with
`os._exit`, or hung until dlaunch killed it cannot; for those the launcher writes the summary
on its behalf (`"written_by": "dlaunch"`), from what it knows:
  - torchrun's ChildFailedError report (exit code or signal of each failed local rank, and
    which one torchrun saw first), parsed from its log;
  - the watcher's Stall (a hang, or a rank that left while others went on);
  - stack dumps the hung ranks wrote on SIGUSR1 (which rank is inside its own code, which
    ones wait inside torch for it).
The summaries carry the time the rank stopped, so `report.aggregate` lists the rank that
caused the failure first; and because they are files, re-reading the run dir later gives the
same result as the launcher printed.

Never imports launcher.runtime (it reads what the ranks left in files), drivers, cli or report.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from launcher.backends.monitor import Beat, Stall, host_pids
from launcher.files import atomic_write_json, read_json, read_jsonl
from launcher.rundir import RunPaths

log = logging.getLogger(__name__)

STACKS_SIGNAL = signal.SIGUSR1  # what runtime.recorder registers with faulthandler
STACK_WAIT_S = 2.0
_TORCH_DIR = f"{os.sep}torch{os.sep}"
_EXIT_RE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")
# a C++ exception nobody caught ends the rank with SIGABRT; its text is only in the stderr log
_TERMINATE_RE = re.compile(r"terminate called after throwing an instance of '(?P<type>[^']+)'")
_WHAT_RE = re.compile(r"what\(\):\s*(?:\[[^\]]*\]\s*)?(?P<msg>\S.*)")
_CAUSE_CHARS = 240  # of the cause quoted from a log into the one-line error
_LOG_TAIL_BYTES = 64 * 1024
_RANK_PREFIX_RE = re.compile(r"^\[rank\d+\]: ?")
_FRAME_RE = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


@dataclass(frozen=True, kw_only=True)
class RankExit:
    """One failed rank in torchrun's report."""

    rank: int
    code: int  # negative: killed by that signal
    root: bool  # torchrun's "first observed failure"


STRAGGLER_SAMPLES = 15  # stack samples per rank when naming a straggler (`name_straggler`)


@dataclass(frozen=True, kw_only=True)
class StackInfo:
    """Where a rank's main thread was when it was asked for its stack."""

    file: str
    line: int
    func: str
    in_torch: bool  # waiting inside torch (a collective, backward, a DataLoader)

    def where(self) -> str:
        """`in loss_fn (tests/data/fault.py:52)`."""
        return f"in {self.func} ({_short(self.file)}:{self.line})"


def parse_torchrun_exits(text: str) -> dict[int, RankExit]:
    """Global rank -> exit of every rank in torchrun's ChildFailedError report in `text`."""
    root_at = text.rfind("Root Cause")
    exits: dict[int, RankExit] = {}
    for m in _EXIT_RE.finditer(text):
        rank, code = int(m.group(1)), int(m.group(2))
        exits[rank] = RankExit(rank=rank, code=code, root=root_at >= 0 and m.start() > root_at)
    return exits


def signal_name(code: int) -> str:
    """`SIGKILL (9)` for exit code -9."""
    try:
        return f"{signal.Signals(-code).name} ({-code})"
    except ValueError:
        return f"signal {-code}"


def dump_stacks(run_dir: str | Path, beats: dict[int, Beat], *,
                wait_s: float = STACK_WAIT_S) -> dict[int, StackInfo]:
    """Ask every rank on this host that can take it for its stacks; parse what they wrote."""
    rd = RunPaths(root=run_dir)
    pids = {r: p for r, p in host_pids(beats).items() if beats[r].stacks}
    sizes: dict[int, int] = {}
    for rank, pid in pids.items():
        path = rd.stacks(rank)
        sizes[rank] = path.stat().st_size if path.exists() else 0
        try:
            os.kill(pid, STACKS_SIGNAL)
        except OSError as e:
            log.debug("rank %d (pid %d): no stack dump: %s", rank, pid, e)
            sizes.pop(rank)
    deadline = time.monotonic() + wait_s
    texts: dict[int, str] = {}
    while sizes and time.monotonic() < deadline:
        time.sleep(0.1)
        for rank in list(sizes):
            path = rd.stacks(rank)
            if path.exists() and path.stat().st_size > sizes[rank]:
                time.sleep(0.1)  # faulthandler writes a frame per write(); let it finish
                with open(path, encoding="utf-8", errors="replace") as f:
                    f.seek(sizes.pop(rank))
                    texts[rank] = f.read()
    return {r: info for r, t in texts.items() if (info := parse_stack_dump(t)) is not None}


def name_straggler(run_dir: str | Path, beats: dict[int, Beat], *, samples: int = STRAGGLER_SAMPLES,
                   gap_s: float = 0.2) -> str | None:
    """Which rank keeps the others waiting, from `samples` stack dumps of every rank a
    `gap_s` apart: in lockstep training the slow rank is the one found in its own code while the
    others wait inside torch (a collective). A sentence naming it when one rank was in its own
    code in at least 70% of the samples and 30 points more often than any other; one saying no
    rank stood out otherwise; None when fewer than two ranks could be sampled."""
    own: dict[int, int] = {}
    seen: dict[int, int] = {}
    where: dict[int, str] = {}
    for i in range(samples):
        for rank, info in dump_stacks(run_dir, beats, wait_s=1.0).items():
            seen[rank] = seen.get(rank, 0) + 1
            if not info.in_torch:
                own[rank] = own.get(rank, 0) + 1
                where[rank] = info.where()
        if i + 1 < samples:
            time.sleep(gap_s)
    if len(seen) < 2:
        return None
    shares = sorted(((own.get(r, 0) / n, r) for r, n in seen.items()), reverse=True)
    (top, rank), (second, _) = shares[0], shares[1]
    if top >= 0.7 and top - second >= 0.3:
        return (f"rank {rank} was in its own code in {own[rank]} of {seen[rank]} stack samples "
                f"({where[rank]}) while the others mostly waited in torch: it is most likely the "
                f"straggler")
    return (f"no rank stood out in {samples} stack samples of each (in own code: "
            + ", ".join(f"rank {r} {share:.0%}" for share, r in sorted(shares, key=lambda x: x[1]))
            + "): the ranks slowed alike (the host, the data or the network)")


def parse_stack_dump(text: str) -> StackInfo | None:
    """The innermost frame of the main thread in a faulthandler dump (all threads)."""
    threads: list[list[tuple[str, int, str]]] = []
    for line in text.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            threads.append([])
        elif (m := _FRAME_RE.match(line)) and threads:
            threads[-1].append((m["file"], int(m["line"]), m["func"]))
    # the main thread is the one running the rank's entry point (or a script's __main__)
    main = next((t for t in threads if any(f.endswith(f"runtime{os.sep}entry.py") for f, _, _ in t)),
                next((t for t in threads if t and t[-1][2] == "<module>"), None))
    if not main:
        return None
    file, line_no, func = main[0]
    return StackInfo(file=file, line=line_no, func=func, in_torch=_TORCH_DIR in file)


def _short(path: str) -> str:
    """A path relative to the working directory, or from `torch/` on, whichever is shorter."""
    i = path.rfind(_TORCH_DIR)
    tail = path[i + 1:] if i >= 0 else path
    try:
        rel = os.path.relpath(path)
    except ValueError:
        rel = path
    return min((tail, rel, path), key=len)


def _rank_facts(run_dir: Path, rank: int, beats: dict[int, Beat]) -> tuple[int, float | None, bool]:
    """(last step, last sign-of-life time, has a rank file) from heartbeat and records."""
    path = RunPaths(root=run_dir).records(rank)
    records = read_jsonl(path)[0] if path.exists() else []
    steps = [int(r["step"]) for r in records if r.get("kind") == "step"]
    times = [float(r["time"]) for r in records if "time" in r]
    beat = beats.get(rank)
    step = max(steps + ([beat.step] if beat else []), default=0)
    last = max(times + ([beat.time] if beat else []), default=None)
    return step, last, bool(records)


def write_missing_summaries(run_dir: str | Path, world_size: int, *, expected_steps: int,
                            beats: dict[int, Beat], stall: Stall | None = None,
                            stacks: dict[int, StackInfo] | None = None,
                            torchrun_log: str = "") -> list[str]:
    """Write a summary for every rank that has none, saying how it ended; returns the lines.

    Call it after the job is over (every rank process gone), before aggregating.
    """
    rd = Path(run_dir)
    stacks = stacks or {}
    exits = parse_torchrun_exits(torchrun_log)
    torchrun_reported = bool(exits)
    hung = set(stall.ranks) if stall is not None and stall.kind == "hang" else set()
    culprits = _culprits(hung, stacks, beats)
    now = time.time()
    lines: list[str] = []
    for rank in range(world_size):
        own = _read_summary(rd, rank)
        # a rank dlaunch stopped for hanging writes "stopped"; the launcher knows why
        if own is not None and not (rank in hung and own.get("status") == "stopped"):
            continue
        step, last, has_file = _rank_facts(rd, rank, beats)
        ex = exits.get(rank)
        # aggregate prints "rank R <status> after N steps: <error>": say only what that lacks
        when = last if last is not None else now
        if rank in hung:
            st = stacks.get(rank)
            if rank in culprits:
                assert stall is not None  # narrowing: hung ranks come from the stall
                status = "hung"
                error = stall.message + (f"; stuck {st.where()}" if st else "")
            else:
                status, when = "hung", now
                waiting = (f"waiting {st.where()}" if st and st.in_torch else
                           (st.where() if st else "stopped advancing"))
                error = f"{waiting}, most likely for rank(s) {', '.join(map(str, sorted(culprits)))}"
        elif ex is not None and ex.code < 0:
            raised = raised_error(rd, rank) if ex.code == -signal.SIGTERM else None
            if raised is not None:
                # the rank had raised before torchrun stopped it: its own error is the cause
                status, error = "failed", f"{raised} (then SIGTERM from torchrun)"
            elif ex.code == -signal.SIGTERM and not ex.root:
                status, when = "stopped", now
                error = "SIGTERM from torchrun after another rank failed (no summary)"
            else:
                status, error = "killed", f"by signal {signal_name(ex.code)}"
                if (cause := abort_cause(rd, rank)) is not None:
                    error += f": {cause}"
                left = stall is not None and stall.kind == "exited" and rank not in stall.ranks
                if left or (not ex.root and any(e.root for e in exits.values())):
                    # another rank failed first (torchrun's root cause) or left early (dlaunch
                    # stopped the job for it), and this one died of the stopping (a SIGABRT in
                    # teardown): listed after the cause
                    when = now
        elif ex is not None:
            status, error = "failed", f"exit code {ex.code} without a summary"
            if (raised := raised_error(rd, rank)) is not None:
                error = f"{raised} (exit code {ex.code})"
        elif (stall is not None and stall.kind == "exited" and rank in stall.ranks) or (
                torchrun_reported and has_file):
            # torchrun lists every rank that failed or that it stopped; one it does not list
            # but that left no summary returned exit code 0 before finishing
            status = "exited"
            error = f"exit code 0 before finishing its {expected_steps} steps (no summary)"
        elif stall is not None:
            status, when = "stopped", now
            error = f"by dlaunch ({stall.kind}: {stall.message})"
        else:
            continue
        summary = {"rank": rank, "status": status, "steps": step, "time": when, "error": error,
                   "written_by": "dlaunch"}
        if own is not None:
            summary = {**own, **summary, "rank_error": own.get("error"),
                       "time": min(when, float(own.get("time", when)))}
        atomic_write_json(RunPaths(root=rd).summary(rank), summary)
        lines.append(f"rank {rank}: {status}: {error}")
    return lines


def abort_cause(run_dir: Path, rank: int) -> str | None:
    """What the C++ exception that aborted rank `rank` said, from its newest stderr log:
    `uncaught gloo::EnforceNotMet: ... Received data size doesn't match expected size ...`."""
    node_rank, local_rank = _placement(run_dir, rank)
    logs = RunPaths(root=run_dir).rank_logs(node_rank, local_rank, "stderr")
    if not logs:
        return None
    try:
        with open(logs[-1], "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - _LOG_TAIL_BYTES))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    kind = what = None
    for line in text.splitlines():
        if m := _TERMINATE_RE.search(line):
            kind, what = m["type"], None
        elif kind is not None and what is None and (m := _WHAT_RE.search(line)):
            what = m["msg"].strip()
    if kind is None:
        return None
    cause = f"uncaught C++ exception {kind}" + (f": {what}" if what else "")
    return cause if len(cause) <= _CAUSE_CHARS else cause[:_CAUSE_CHARS - 3] + "..."


def raised_error(run_dir: Path, rank: int) -> str | None:
    """The exception line of the last Python traceback in rank `rank`'s newest stderr log
    (`RuntimeError: Distributed package doesn't have NCCL built in`), or None."""
    node_rank, local_rank = _placement(run_dir, rank)
    logs = RunPaths(root=run_dir).rank_logs(node_rank, local_rank, "stderr")
    try:
        text = logs[-1].read_text(encoding="utf-8", errors="replace") if logs else ""
    except OSError:
        return None
    # after init_process_group torch prefixes a rank's traceback lines with "[rank<r>]: "
    lines = [_RANK_PREFIX_RE.sub("", line, count=1) for line in text.splitlines()]
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if not starts:
        return None
    # the exception line is the first unindented line after the frames
    tail = (line for line in lines[starts[-1] + 1:] if line.strip() and not line[0].isspace())
    what = next(tail, None)
    if what is None:
        return None
    return what if len(what) <= _CAUSE_CHARS else what[:_CAUSE_CHARS - 3] + "..."


def _placement(run_dir: Path, rank: int) -> tuple[int, int]:
    """(node rank, local rank) of `rank` from its start record; (0, rank) on one node."""
    path = RunPaths(root=run_dir).records(rank)
    records = read_jsonl(path)[0] if path.exists() else []
    start = next((r for r in records if isinstance(r, dict) and r.get("kind") == "start"), {})
    try:
        return int(start.get("node_rank", 0)), int(start.get("local_rank", rank))
    except (TypeError, ValueError):
        return 0, rank


def _read_summary(run_dir: Path, rank: int) -> dict | None:
    path = RunPaths(root=run_dir).summary(rank)
    if not path.exists():
        return None
    try:
        data = read_json(path)
    except ValueError:
        data = None
    # unreadable: aggregate reports it; never overwrite what may be evidence
    return data if isinstance(data, dict) else {"status": "unreadable"}


def _culprits(hung: set[int], stacks: dict[int, StackInfo], beats: dict[int, Beat]) -> set[int]:
    """The hung ranks most likely to blame: those not waiting inside torch; else the laggards."""
    if not hung:
        return set()
    outside = {r for r in hung if r in stacks and not stacks[r].in_torch}
    if outside:
        return outside
    steps = {r: beats[r].step if r in beats else -1 for r in hung}
    low = min(steps.values())
    laggards = {r for r, s in steps.items() if s == low}
    return laggards if len(laggards) < len(hung) else set(hung)

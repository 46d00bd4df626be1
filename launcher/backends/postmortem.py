"""After a job ended badly: find out how each rank ended and leave it in the run dir.

A rank that raises writes its own summary. A rank that was SIGKILLed, exited early with
`os._exit`, or hung until dlaunch killed it cannot; for those the launcher writes the summary
on its behalf (`"written_by": "dlaunch"`), from what it knows:
  - torchrun's ChildFailedError report (exit code or signal of each failed local rank, and
    which one torchrun saw first), parsed from its log;
  - the watcher's Stall (a hang, or a rank that left while others went on);
  - stack dumps the hung ranks wrote on SIGUSR1 (which rank is inside its own code or its
    DataLoader, which ones wait inside torch for it), and where a rank stopped by SIGTERM
    was when a peer's collective timed out waiting for it (`launcher.backends.stacks`).
The summaries carry the time the rank stopped, so `report.aggregate` lists the rank that caused
the failure first, and re-reading the run dir later gives what the launcher printed. Never
imports launcher.runtime (it reads what the ranks left in files), drivers, cli or report.
"""

from __future__ import annotations

import math
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from launcher.backends.monitor import Beat, Stall
from launcher.backends.stacks import StackInfo, stopped_where
from launcher.files import atomic_write_json, read_json, read_jsonl
from launcher.rundir import RunPaths

_EXIT_RE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")
# a C++ exception nobody caught ends the rank with SIGABRT; its text is only in the stderr log
_TERMINATE_RE = re.compile(r"terminate called after throwing an instance of '(?P<type>[^']+)'")
_WHAT_RE = re.compile(r"what\(\):\s*(?:\[[^\]]*\]\s*)?(?P<msg>\S.*)")
_CAUSE_CHARS = 240  # of the cause quoted from a log into the one-line error
_LOG_TAIL_BYTES = 64 * 1024
_RANK_PREFIX_RE = re.compile(r"^\[rank\d+\]: ?")
# a rank's own error when a collective it waited in timed out (gloo's recv/send, NCCL's watchdog)
_COLLECTIVE_TIMEOUT_RE = re.compile(r"Timed out waiting \d+ms for (?:recv|send)|collective operation timeout|"
                                    r"Watchdog caught collective", re.I)
# what a rank raises when a peer's process vanished under a collective (gloo's TCP pair, NCCL's
# remote error): the consequence of that peer's death, never its cause
_PEER_LOST_RE = re.compile(r"(?:closed|reset) by peer|remote (?:worker|process)|ncclRemoteError", re.I)


@dataclass(frozen=True, kw_only=True)
class RankExit:
    """One failed rank in torchrun's report."""

    rank: int
    code: int  # negative: killed by that signal
    root: bool  # torchrun's "first observed failure"


def parse_torchrun_exits(text: str) -> dict[int, RankExit]:
    """Global rank -> exit of every rank in torchrun's ChildFailedError report in `text`."""
    root_at = text.rfind("Root Cause")
    return {int(m[1]): RankExit(rank=int(m[1]), code=int(m[2]), root=root_at >= 0 and m.start() > root_at)
            for m in _EXIT_RE.finditer(text)}


def signal_name(code: int) -> str:
    """`SIGKILL (9)` for exit code -9."""
    try:
        return f"{signal.Signals(-code).name} ({-code})"
    except ValueError:
        return f"signal {-code}"


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


def _lost_a_peer(run_dir: Path, rank: int) -> bool:
    """Whether `rank` says it failed because a peer's process vanished under a collective (in its
    summary, or for one whose summary said ok, in what it raised as it exited)."""
    own = _read_summary(run_dir, rank)
    if own is None:
        return False
    said = (raised_error(run_dir, rank) or "") if own.get("status") == "ok" else str(own.get("error", ""))
    return bool(_PEER_LOST_RE.search(said))


def write_missing_summaries(run_dir: str | Path, world_size: int, *, expected_steps: int | None, beats: dict[int, Beat],
                            stall: Stall | None = None, stacks: dict[int, StackInfo] | None = None,
                            torchrun_log: str = "") -> list[str]:
    """Write a summary for every rank that has none, saying how it ended; returns the lines.
    Call it after the job is over (every rank process gone), before aggregating."""
    rd = Path(run_dir)
    stacks = stacks or {}
    exits = parse_torchrun_exits(torchrun_log)
    hung = set(stall.ranks) if stall is not None and stall.kind == "hang" else set()
    culprits = _culprits(hung, stacks, beats)
    # torchrun's root cause, unless it only lost its peer (it exited before torchrun saw the
    # signal of the rank that died): read once, not per rank
    rooted = any(e.root and not _lost_a_peer(rd, r) for r, e in exits.items())
    now = time.time()
    lines: list[str] = []
    for rank in range(world_size):
        own = _read_summary(rd, rank)
        ex = exits.get(rank)
        # a rank that wrote "ok", then failed as it exited (an atexit handler, a crash in teardown)
        after_ok = own is not None and own.get("status") == "ok" and ex is not None
        # a rank dlaunch stopped for hanging writes "stopped"; the launcher knows why
        if own is not None and not after_ok and not (rank in hung and own.get("status") == "stopped"):
            continue
        step, last, has_file = _rank_facts(rd, rank, beats)
        # aggregate prints "rank R <status> after N steps: <error>": say only what that lacks
        when = last if last is not None else now
        if after_ok:
            assert own is not None and ex is not None  # narrowing: after_ok says both are
            signalled = ex.code < 0 or ex.code == 128 + signal.SIGTERM
            how = f"by signal {signal_name(ex.code)}" if ex.code < 0 else f"exit code {ex.code}"
            if (signalled and stall is not None) or (not ex.root and rooted) or _lost_a_peer(rd, rank):
                # stopped or taken down while exiting, by dlaunch or by another rank's failure: listed after it
                status, when = ("stopped" if signalled else "failed"), now
                error = (f"{how} as it exited, after "
                         f"{'dlaunch stopped the job' if stall is not None else 'another rank failed'}")
            else:
                status = "killed" if ex.code < 0 else "failed"
                error = f"{how} as it exited, after its summary said ok"
                when = float(own.get("time", when))  # it failed no earlier: what it did first
        elif rank in hung:
            st = stacks.get(rank)
            if rank in culprits:
                assert stall is not None  # narrowing: hung ranks come from the stall
                status, error = "hung", stall.message + (f"; stuck {st.where()}" if st else "")
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
                if left or (not ex.root and rooted):
                    # another rank failed first (torchrun's root cause) or left early (dlaunch
                    # stopped the job for it), and this one died of the stopping (a SIGABRT in
                    # teardown): listed after the cause
                    when = now
        elif ex is not None:
            status, error = "failed", f"exit code {ex.code} without a summary"
            if (raised := raised_error(rd, rank)) is not None:
                error = f"{raised} (exit code {ex.code})"
            elif ex.code == 128 + signal.SIGTERM and not ex.root and rooted:
                # SIGTERM's exit code, torchrun's stopping after its root cause: listed after it
                when = now
        elif (stall is not None and stall.kind == "exited" and rank in stall.ranks) or (
                exits and has_file):
            # torchrun lists every rank that failed or that it stopped; one it does not list
            # but that left no summary returned exit code 0 before finishing
            status, error = "exited", ("exit code 0 before the others finished (no summary)" if expected_steps is None
                                       else f"exit code 0 before finishing its {expected_steps} steps (no summary)")
        elif stall is not None:
            status, when = "stopped", now
            error = f"by dlaunch ({stall.kind}: {stall.message})"
        else:
            continue
        summary = {"rank": rank, "status": status, "steps": step, "time": when, "error": error, "written_by": "dlaunch"}
        if own is not None:
            # one that said ok ended after it (`when`); any other stopped no later than its summary
            summary = {**own, **summary, "rank_error": own.get("error"),
                       "time": when if after_ok else min(when, float(own.get("time", when)))}
        atomic_write_json(RunPaths(root=rd).summary(rank), summary)
        lines.append(f"rank {rank}: {status}: {error}")
    if not hung:
        lines += _blame_the_stuck(rd, world_size, beats)
    leaver = expected_steps is None and (stall is None or stall.kind == "exited")  # a script, not stopped by dlaunch
    return lines + (_blame_the_leaver(rd, world_size, exits) if leaver else [])


def _blame_the_leaver(run_dir: Path, world_size: int, exits: dict[int, RankExit]) -> list[str]:
    """A plain script's rank that ended ok, exit code 0, before a peer's collective lost it (its
    `sys.exit(0)` on one rank) left early, and caused that failure: its summary says so and keeps
    its own time (listed first). A workload's ranks all run the harness's loop: never one of them."""
    summaries = {r: s for r in range(world_size) if (s := _read_summary(run_dir, r)) is not None}
    when = {r: t for r, s in summaries.items() if isinstance(t := s.get("time"), (int, float))}
    lost = {r: when[r] for r, s in summaries.items() if r in when and s.get("status") == "failed"
            and _PEER_LOST_RE.search(str(s.get("error", "")))}
    lines: list[str] = []
    for rank, own in sorted(summaries.items()):
        if lost and own.get("status") == "ok" and rank not in exits and when.get(rank, math.inf) < min(lost.values()):
            error = f"exit code 0 while rank(s) {', '.join(map(str, sorted(lost)))} went on and lost it in a collective"
            atomic_write_json(RunPaths(root=run_dir).summary(rank),
                              {**own, "status": "exited", "error": error, "written_by": "dlaunch"})
            lines.append(f"rank {rank}: exited: {error}")
    return lines


def _blame_the_stuck(run_dir: Path, world_size: int, beats: dict[int, Beat]) -> list[str]:
    """When a rank's collective timed out before dlaunch called the job hung (a rank stuck from the
    first step is still 'starting up'), blame the rank it waited for: one stopped outside torch.
    Its summary says where it stuck and takes its last sign of life as its time (listed first)."""
    summaries = {r: s for r in range(world_size) if (s := _read_summary(run_dir, r)) is not None}
    timed_out = {r: float(s.get("time", 0.0)) for r, s in summaries.items() if s.get("status") == "failed"
                 and _COLLECTIVE_TIMEOUT_RE.search(str(s.get("error", "")))}
    lines: list[str] = []
    for rank, own in sorted(summaries.items()):
        if not timed_out or own.get("status") != "stopped" or own.get("written_by") == "dlaunch":
            continue
        st = stopped_where(str(own.get("traceback", "")))
        if st is None or st.in_torch:
            continue
        step, last, _ = _rank_facts(run_dir, rank, beats)
        error = (f"stuck {st.where()} at step {step + 1}: rank(s) {', '.join(map(str, sorted(timed_out)))} "
                 "timed out waiting for it in a collective")
        # it stopped advancing before the collective that waited for it timed out
        first = min(timed_out.values()) - 1e-3
        summary = {**own, "status": "hung", "error": error, "rank_error": own.get("error"),
                   "time": min(last or first, first), "written_by": "dlaunch"}
        atomic_write_json(RunPaths(root=run_dir).summary(rank), summary)
        lines.append(f"rank {rank}: hung: {error}")
    return lines


def abort_cause(run_dir: Path, rank: int) -> str | None:
    """What the C++ exception that aborted rank `rank` said, from its newest stderr log:
    `uncaught gloo::EnforceNotMet: ... Received data size doesn't match expected size ...`."""
    path = _stderr_log(run_dir, rank)
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
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
    return _clip(f"uncaught C++ exception {kind}" + (f": {what}" if what else ""))


def raised_error(run_dir: Path, rank: int) -> str | None:
    """The exception line of the last Python traceback in rank `rank`'s newest stderr log
    (`RuntimeError: Distributed package doesn't have NCCL built in`), or None."""
    path = _stderr_log(run_dir, rank)
    try:
        text = path.read_text(encoding="utf-8", errors="replace") if path else ""
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
    return None if what is None else _clip(what)


def _clip(cause: str) -> str:
    return cause if len(cause) <= _CAUSE_CHARS else cause[:_CAUSE_CHARS - 3] + "..."


def _stderr_log(run_dir: Path, rank: int) -> Path | None:
    """The newest stderr log of `rank` (where its start record places it; node 0 without one)."""
    path = RunPaths(root=run_dir).records(rank)
    records = read_jsonl(path)[0] if path.exists() else []
    start = next((r for r in records if isinstance(r, dict) and r.get("kind") == "start"), {})
    try:
        node_rank, local_rank = int(start.get("node_rank", 0)), int(start.get("local_rank", rank))
    except (TypeError, ValueError):
        node_rank, local_rank = 0, rank
    logs = RunPaths(root=run_dir).rank_logs(node_rank, local_rank, "stderr")
    return logs[-1] if logs else None


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

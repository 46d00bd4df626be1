"""Where a rank's main thread is: the stack dumps ranks write on SIGUSR1 (faulthandler, all
threads) and the traceback a rank keeps when a SIGTERM stopped it, read as a `StackInfo`: in
the rank's own code, inside torch (most likely waiting for a peer in a collective), or
waiting for its DataLoader's next batch. The post-mortem blames hung ranks from it, and the
drift alarm names a straggler from repeated samples (`name_straggler`). Never imports
launcher.runtime (it reads what the ranks left in files), drivers, cli or report.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from launcher.backends.monitor import Beat, host_pids
from launcher.rundir import RunPaths

log = logging.getLogger(__name__)

STACKS_SIGNAL = signal.SIGUSR1  # what runtime.recorder registers with faulthandler
STACK_WAIT_S = 2.0
_TORCH_DIR = f"{os.sep}torch{os.sep}"
_FRAME_RE = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
_TRACEBACK_FRAME_RE = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)', re.M)
_DATA_DIR = f"{_TORCH_DIR}utils{os.sep}data{os.sep}"
_ENTRY = f"runtime{os.sep}entry.py"  # a rank's entry point; also the frame its SIGTERM handler adds
STRAGGLER_SAMPLES = 15  # stack samples per rank when naming a straggler (`name_straggler`)


@dataclass(frozen=True, kw_only=True)
class StackInfo:
    """Where a rank's main thread was when it was asked for its stack."""

    file: str
    line: int
    func: str
    in_torch: bool  # inside torch (a collective, backward), so most likely waiting for a peer
    # waiting for its DataLoader's next batch (the frame is where the batch was asked for)
    data: bool = False

    def where(self) -> str:
        """`in loss_fn (tests/data/fault.py:52)`."""
        if self.data:
            return f"waiting for its DataLoader's next batch ({_short(self.file)}:{self.line})"
        return f"in {self.func} ({_short(self.file)}:{self.line})"


def _stack_info(frames: list[tuple[str, int, str]]) -> StackInfo | None:
    """Where a thread was, from its frames (outermost first): the call into torch's DataLoader when
    it waited there (stuck on its input pipeline, not on a peer), else the innermost frame."""
    if not frames:
        return None
    into_data = next((i for i, (f, _, _) in enumerate(frames) if _DATA_DIR in f), 0)
    if into_data > 0:
        file, line, func = frames[into_data - 1]
        return StackInfo(file=file, line=line, func=func, in_torch=False, data=True)
    file, line, func = frames[-1]
    return StackInfo(file=file, line=line, func=func, in_torch=_TORCH_DIR in file)


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
    """Which rank keeps the others waiting, from `samples` stack dumps of every rank `gap_s` apart:
    in lockstep training the slow rank is found in its own code while the others wait in torch (a
    collective). A sentence naming it when one rank was in its own code in >= 70% of the samples
    and 30 points more often than any other, else one saying none stood out; None below 2 ranks."""
    own: Counter[int] = Counter()
    seen: Counter[int] = Counter()
    where: dict[int, str] = {}
    for i in range(samples):
        for rank, info in dump_stacks(run_dir, beats, wait_s=1.0).items():
            seen[rank] += 1
            if not info.in_torch:
                own[rank] += 1
                where[rank] = info.where()
        if i + 1 < samples:
            time.sleep(gap_s)
    if len(seen) < 2:
        return None
    shares = sorted(((own[r] / n, r) for r, n in seen.items()), reverse=True)
    (top, rank), (second, _) = shares[0], shares[1]
    if top >= 0.7 and top - second >= 0.3:
        return (f"rank {rank} was in its own code in {own[rank]} of {seen[rank]} stack samples ({where[rank]}) "
                "while the others mostly waited in torch: it is most likely the straggler")
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
    main = next((t for t in threads if any(f.endswith(_ENTRY) for f, _, _ in t)),
                next((t for t in threads if t and t[-1][2] == "<module>"), None))
    return _stack_info(main[::-1]) if main else None  # faulthandler lists the innermost first


def stopped_where(traceback: str) -> StackInfo | None:
    """Where a rank was when a SIGTERM stopped it, from its summary's traceback (minus the handler's frames)."""
    frames = [(m["file"], int(m["line"]), m["func"]) for m in _TRACEBACK_FRAME_RE.finditer(traceback)]
    while frames and frames[-1][0].endswith(_ENTRY):
        frames.pop()
    return _stack_info(frames)


def _short(path: str) -> str:
    """A path relative to the working directory, or from `torch/` on, whichever is shorter."""
    i = path.rfind(_TORCH_DIR)
    tail = path[i + 1:] if i >= 0 else path
    try:
        rel = os.path.relpath(path)
    except ValueError:
        rel = path
    return min((tail, rel, path), key=len)

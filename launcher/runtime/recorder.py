"""Per-rank metrics: `RUN_DIR/rank-<r>.jsonl` (appended in whole lines) and
`RUN_DIR/rank-<r>.summary.json` (written atomically once, at the end).

Records (one JSON object per line, `kind` first):
  start  run_id, rank, local_rank, node_rank, world_size, host, pid, device, strategy, precision,
         sample_units, units_per_sample, micro_batch, grad_accum, time
  step   step, time, end_time, step_time_s, data_wait_s, samples, units, loss, peak_mem_bytes,
         warmup. `end_time` is the wall clock (time.time()) at the step's end: on CUDA when its
         end event completed (runtime.window). The last warm-up step's end_time is the end of
         warm-up; throughput is measured from there to the last step's end_time.
  comm   calibration of communication (see harness)
  end    time, steps, status
Every record carries the run's `run_id` (from DLAUNCH_RUN_ID, when the launcher set it).
The start and end records carry `host_load` {load_1m, usable_cores, steal_ticks, total_ticks},
from which results tell a busy or oversubscribed host (the steal share is the counters'
difference over the run). The start record also carries `attempt` (0, or the restart number
under `--max-restarts` or of a requeued SLURM job); runtime.resume adds `resume` and `checkpoint`.

The heartbeat file `rank-<r>.heartbeat` ({step, time, pid, host, stacks}) is what the launcher's
hang watcher (launcher.backends.monitor) reads: it is replaced atomically at every flush and
whenever a step record is added at least `BEAT_INTERVAL_S` after the last beat, never with a
device sync. A flusher thread makes one trailing flush `BEAT_INTERVAL_S` after the last beat of
a burst of steps, so none is lost if the rank stops right after them (it never beats for a rank
that makes no progress). With `dump_stacks=True` SIGUSR1 writes every thread's Python stack to
`rank-<r>.stacks`: the watcher tells the rank stuck in its own code from the ranks waiting for it.

A rank doing one long thing that has no steps (writing the CUDA memory snapshot) wraps it in
`busy(what)`: a thread then beats every `BEAT_INTERVAL_S` until it ends, the heartbeat carrying
`busy` (what) and `busy_beats` (a growing count: a live rank, not a stale file). The thread runs
only inside that one call, so it can never hide a rank stuck in training.

Never imports cli, backends, jobs or report, nor torch: plain scripts use it through `meter`.
"""

from __future__ import annotations

import errno
import faulthandler
import json
import logging
import os
import re
import signal
import socket
import threading
import time
import traceback as tb
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from launcher.files import append_lines, atomic_write_json, atomic_write_text
from launcher.rundir import RunPaths

log = logging.getLogger(__name__)

BEAT_INTERVAL_S = 1.0
STACKS_SIGNAL = signal.SIGUSR1
# kept open for the life of the process: faulthandler writes to its fd from a signal handler
_stack_files: list[IO[str]] = []


def write_beat(path: Path, step: int, **fields: Any) -> None:
    """The heartbeat file ({step, time, host, ...}); no fsync: it is rewritten every second and
    its readers only need it whole, never durable."""
    beat = {"step": step, "time": time.time(), "host": socket.gethostname(), **fields}
    atomic_write_text(path, json.dumps(beat), fsync=False)


class RankRecorder:
    """Buffers step records and appends them at window ends; writes the final summary."""

    def __init__(self, run_dir: str | Path, rank: int, start: dict[str, Any], *, dump_stacks: bool = False) -> None:
        self.run_dir = Path(run_dir)
        self.rank = rank
        self._paths = RunPaths(root=self.run_dir)
        self.path = self._paths.records(rank)
        self._heartbeat = self._paths.heartbeat(rank)
        self._buffer: list[dict[str, Any]] = []
        self.steps_done = 0
        self._finished = False
        self._last_beat = 0.0
        self._busy: str | None = None  # what `busy` is waiting for, while it is
        self._busy_beats = 0
        self._stepped = False  # a step record was added in this process
        self._beat_lock = threading.Lock()  # `busy`'s thread beats beside the caller
        self._records_lock = threading.Lock()  # the trailing flush writes beside the caller
        # one long-lived thread makes the trailing flush (see `progress`); started at first need
        self._steps_pending, self._stopped = threading.Event(), threading.Event()
        self._flusher: threading.Thread | None = None
        # before the first heartbeat: the watcher only signals ranks whose heartbeat says
        # they can take it (SIGUSR1's default action would kill the rank)
        self._stacks = dump_stacks and _enable_stack_dumps(self._paths.stacks(rank))
        # a --max-restarts relaunch, or a requeued SLURM job (its restart count)
        attempt = int(os.environ.get("DLAUNCH_ATTEMPT") or os.environ.get("DLAUNCH_SLURM_RESTART_COUNT") or 0)
        # on every record: an orphaned rank of an earlier run appending into a reused file is told
        # apart line by line (a plain script's meter gets it only from the launcher's environment)
        self._run_id = {"run_id": os.environ["DLAUNCH_RUN_ID"]} if os.environ.get("DLAUNCH_RUN_ID") else {}
        append_lines(self.path, [{"kind": "start", "rank": rank, "pid": os.getpid(), "time": time.time(),
                                  "attempt": attempt, **self._run_id, **start, "host_load": host_load()}])
        self.heartbeat(0)

    def add(self, record: dict[str, Any]) -> None:
        """Queue a record (written at the next flush); a step record may beat the heartbeat."""
        with self._records_lock:
            self._buffer.append(record)
        kind = record.get("kind")
        # a resume counts the steps its checkpoint covers: the summary says how far the run got
        if kind in ("step", "resume"):
            self.steps_done = max(self.steps_done, int(record["step"]))
        if kind == "step":
            if not self._stepped:
                # the first step of this process ends its start-up: say so at once, or a hang
                # a few fast steps later is judged by the start-up timeout (minutes), not the
                # hang timeout (a resume record alone must not: the rank has not stepped yet)
                self._stepped = True
                self.heartbeat(self.steps_done)
            else:
                self.progress(self.steps_done)

    def progress(self, step: int) -> None:
        """Cheap liveness mark, callable once per step: beats when >= BEAT_INTERVAL_S passed, else
        marks the step pending for the flusher thread's trailing flush."""
        if time.monotonic() - self._last_beat >= BEAT_INTERVAL_S:
            self.heartbeat(step)
        elif not self._finished:
            self._steps_pending.set()
            if self._flusher is None:
                self._flusher = threading.Thread(target=self._flush_loop, name="dlaunch-flusher", daemon=True)
                self._flusher.start()

    def _flush_loop(self) -> None:
        """The flusher thread (see `progress`); a failed flush leaves the records queued."""
        while not self._stopped.is_set():
            self._steps_pending.wait()
            self._steps_pending.clear()  # before the wait: a step during it marks again
            delay = self._last_beat + BEAT_INTERVAL_S - time.monotonic()
            if self._stopped.wait(max(delay, 0.0)):
                return
            if time.monotonic() - self._last_beat < BEAT_INTERVAL_S:
                continue  # a beat came meanwhile: the steps are still coming
            try:
                self.flush()
            except Exception as e:  # noqa: BLE001 - a thread: the rank's own flush reports it
                log.debug("trailing flush failed: %s", e)

    def flush(self) -> None:
        """Append every queued record in one write, then beat the heartbeat."""
        with self._records_lock:
            if self._buffer:
                append_lines(self.path, [{**r, **self._run_id} for r in self._buffer])
                self._buffer = []  # only once written: a failed write leaves them queued
        self.heartbeat(self.steps_done)

    def heartbeat(self, step: int) -> None:
        """Record progress for the launcher's hang detection (small file, replaced atomically)."""
        with self._beat_lock:
            self._last_beat = time.monotonic()
            busy = {} if self._busy is None else {"busy": self._busy, "busy_beats": self._busy_beats}
            write_beat(self._heartbeat, step, pid=os.getpid(), stacks=self._stacks, **busy)

    def alive(self, what: str) -> None:
        """A sign of life between steps (a batch fetched by an evaluation loop): progress for the
        hang watcher, as `busy`'s beats are; at most one beat per BEAT_INTERVAL_S."""
        if time.monotonic() - self._last_beat < BEAT_INTERVAL_S:
            return
        with self._beat_lock:
            self._busy, self._busy_beats = what, self._busy_beats + 1
        self.heartbeat(self.steps_done)

    @contextmanager
    def busy(self, what: str, interval_s: float = BEAT_INTERVAL_S) -> Iterator[None]:
        """Beat every `interval_s` from a thread while the caller does `what` (one long call with
        no steps); the beats name it and count up in `busy_beats`. Ends with one plain beat."""
        stop = threading.Event()

        def beat() -> None:
            with self._beat_lock:
                self._busy_beats += 1
            self.heartbeat(self.steps_done)

        def loop() -> None:
            while not stop.wait(interval_s):
                try:
                    beat()
                except OSError as e:  # a full disk must not end the rank from this thread
                    log.debug("busy heartbeat failed: %s", e)

        self._busy = what
        beat()
        thread = threading.Thread(target=loop, name="dlaunch-busy-beat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            self._busy = None
            self.heartbeat(self.steps_done)

    def finish(self, status: str, *, error: BaseException | None = None, extra: dict[str, Any] | None = None) -> None:
        """Flush, append the end record and write the summary; only the first call counts."""
        if self._finished:
            return
        self._finished = True
        self._stopped.set()
        self._steps_pending.set()  # wakes the flusher so that it sees the stop
        self.flush()
        now = time.time()
        summary: dict[str, Any] = {"rank": self.rank, "status": status, "steps": self.steps_done,
                                   "time": now, **(extra or {})}
        if error is not None:
            summary["error"] = error_line(error)
            summary["traceback"] = "".join(tb.format_exception(error))
        append_lines(self.path, [{"kind": "end", "time": now, "steps": self.steps_done,
                                  "status": status, "host_load": host_load(), **self._run_id}])
        atomic_write_json(self._paths.summary(self.rank), summary)


# what the disk said, wherever a write failed: no space, no quota, a read-only file system
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
_WORKER = re.compile(r"Caught \w+ in DataLoader worker process (\d+)")


def rank_failures(e: BaseException) -> list[object]:
    """The per-rank failures a distributed checkpoint's exception collected (`failures`: rank ->
    (exception, stack)), each rank's exception; [] for any other exception."""
    return [x[0] if isinstance(x, tuple) else x for x in (getattr(e, "failures", None) or {}).values()]


def _disk_error(e: BaseException, seen: int = 0) -> OSError | None:
    """The disk's OSError behind `e`: itself, its cause or context, or one of `rank_failures`."""
    if isinstance(e, OSError) and e.errno in _DISK_FULL:
        return e
    for nested in (e.__cause__, e.__context__, *rank_failures(e)):
        if isinstance(nested, BaseException) and seen < 8:
            found = _disk_error(nested, seen + 1)
            if found is not None:
                return found
    return None


def error_line(e: BaseException) -> str:
    """The one line naming a rank's failure, its cause first: the disk's error wherever a write
    failed, or a DataLoader worker's own exception (their first lines name only ranks or worker)."""
    disk = _disk_error(e)
    if disk is not None:
        where = f" writing {disk.filename}" if disk.filename else ""
        return (f"{errno.errorcode.get(disk.errno or 0, 'OSError')}: {os.strerror(disk.errno or 0)}{where}"
                + ("" if disk is e else f" (raised as {type(e).__name__})"))
    text = str(e).strip()
    worker = _WORKER.match(text)
    if worker:
        return f"{text.splitlines()[-1].strip()} (in DataLoader worker process {worker.group(1)})"
    return f"{type(e).__name__}: {text}".strip()


def host_load(proc: Path = Path("/proc")) -> dict[str, Any]:
    """This host's 1-minute load average, usable cores and /proc/stat CPU time counters (all, and
    steal: time a hypervisor gave this VM's CPUs to others); missing values are left out."""
    out: dict[str, Any] = {}
    try:
        out["load_1m"] = float((proc / "loadavg").read_text().split()[0])
        cpu = (proc / "stat").read_text().splitlines()[0].split()
        if cpu[0] == "cpu" and len(cpu) > 8:
            ticks = [int(x) for x in cpu[1:]]
            # guest time is already inside user and nice: leave it out of the total
            out["total_ticks"], out["steal_ticks"] = sum(ticks[:8]), ticks[7]
    except (OSError, ValueError, IndexError) as e:
        log.debug("no load figures: %s", e)
    try:
        # deferred: only the rank's start and end need it (psutil, cgroup files)
        from launcher.hardware.detect import usable_cores

        out["usable_cores"] = usable_cores()
    except (ImportError, OSError, ValueError) as e:
        log.debug("no usable core count: %s", e)
    return out


def _enable_stack_dumps(path: Path) -> bool:
    """Dump every thread's Python stack to `path` on SIGUSR1; False when that is impossible.
    faulthandler writes from the C signal handler, so the dump works even while the main thread
    is blocked inside a collective (where a Python-level handler would never run)."""

    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        f = os.fdopen(fd, "a", encoding="utf-8")
        faulthandler.register(STACKS_SIGNAL, file=f, all_threads=True, chain=False)
    except (OSError, RuntimeError, ValueError) as e:
        log.debug("no stack dumps on %s: %s", STACKS_SIGNAL.name, e)
        return False
    _stack_files.append(f)
    return True

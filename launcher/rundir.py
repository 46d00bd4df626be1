"""Run directories: unique ids, creation that never reuses a directory, and the name of every
file in one (`RunPaths`), in a sweep directory (`SweepPaths`) or in a tune directory (`TunePaths`).

These names are the on-disk protocol between the launcher, the ranks and the report: old run
dirs must keep reading, so a name here never changes. Ranks import this module too, so it
imports nothing heavier than the standard library and `launcher.errors`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, overload

from launcher.errors import LaunchError

log = logging.getLogger(__name__)

_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")

# the names other modules use too; the rest are named once, in RunPaths / SweepPaths / TunePaths
OWNER_FILE = "owner.json"  # which dlaunch claimed the dir (and the torchrun it started)
LAUNCH_FILE = "launch.json"  # the launch spec (secrets masked); ranks read it to start
SLURM_FILE = "slurm.json"  # the SLURM job a `run --slurm` submitted
NODE_FILE = "node.json"  # in each node's log dir: which host had which SLURM node id
CHECKPOINT_DIR_ENV = "DLAUNCH_CHECKPOINT_DIR"  # the user's checkpoint folder, and the ranks'
REPORT_SUBDIR = "report"  # where `dlaunch report DIR` writes by default (run, sweep or tune dir)
TUNE_RECORD = "tune.json"  # `dlaunch tune`'s table: every trial, predicted and measured

# per-rank files: rank-<r><suffix>
RECORDS = ".jsonl"  # the rank's records, appended in whole lines
SUMMARY = ".summary.json"  # how the rank ended, written once
HEARTBEAT = ".heartbeat"  # replaced at every flush; the launcher's hang detection reads it
STACKS = ".stacks"  # Python stacks of every thread, dumped on SIGUSR1
_RANK_PREFIX = "rank-"
_ATTEMPT_SUFFIXES = (RECORDS, SUMMARY, HEARTBEAT, STACKS)


class _In:
    """A fixed name in the directory: `paths.launch` is `paths.root / LAUNCH_FILE`."""

    def __init__(self, name: str, doc: str) -> None:
        self.name = name
        self.__doc__ = doc

    @overload
    def __get__(self, paths: None, owner: type) -> _In: ...
    @overload
    def __get__(self, paths: _Dir, owner: type) -> Path: ...
    def __get__(self, paths: _Dir | None, owner: type) -> Path | _In:
        return self if paths is None else paths.root / self.name


@dataclass(frozen=True, kw_only=True)
class _Dir:
    """A directory; `root` may be given as a str."""

    root: Path

    if TYPE_CHECKING:  # what the generated __init__ accepts: __post_init__ makes it a Path
        def __init__(self, *, root: str | Path) -> None: ...

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))


class RunPaths(_Dir):
    """Where each file of the run directory `root` lives."""

    owner = _In(OWNER_FILE, "Which dlaunch process claimed the run dir, and its torchrun.")
    launch = _In(LAUNCH_FILE, "The launch spec.")
    result = _In("result.json", "The aggregated result, written once the ranks are done.")
    plan = _In("plan.json", "The plan the run followed, beside its results (predicted vs measured).")
    slurm = _In(SLURM_FILE, "The SLURM job record.")
    submitit = _In("slurm", "submitit's folder: its pickles and per-task logs.")
    attempts_record = _In("attempts.json", "Why each attempt of a restarted run ended.")
    launcher_warnings = _In("launcher-warnings.json", "The launcher's warnings while the ranks ran: a JSON list.")
    attempts = _In("attempts", "The earlier attempts' folder: attempts/<n>/ holds attempt n's rank files and logs.")
    lab = _In("lab.json", "`dlaunch lab`'s comparison, beside the base run.")
    torchrun_log = _In("torchrun.log", "torchrun's own output (rank lines go to the console).")
    console_log = _In("console.log", "The console output of a run launched by a sweep or a tune.")
    logs = _In("logs", "torchrun's log folder, one subfolder per node (node-<n>/).")
    checkpoints = _In("checkpoints", "The default checkpoint folder (DLAUNCH_CHECKPOINT_DIR overrides it).")
    report = _In(REPORT_SUBDIR, "Where `dlaunch report` writes the run's report by default.")

    def attempt(self, attempt: int) -> RunPaths:
        """Attempt `attempt`'s files, moved aside before the relaunch (same layout)."""
        return RunPaths(root=self.attempts / str(attempt))

    def attempt_files(self) -> list[Path]:
        """What belongs to one attempt and is moved aside before a relaunch."""
        found = [p for suffix in _ATTEMPT_SUFFIXES for p in self.rank_files(suffix).values()]
        return found + ([self.logs] if self.logs.exists() else [])

    def node_logs(self, node_rank: int | str) -> Path:
        """Where torchrun on node `node_rank` keeps its ranks' log files (a str: a shell
        placeholder, in a command printed for a node not yet known)."""
        return self.logs / f"node-{node_rank}"

    def node_records(self) -> list[Path]:
        """The node.json every SLURM node task wrote into its log folder."""
        return sorted(self.logs.glob(f"node-*/{NODE_FILE}"))

    def rank_logs(self, node_rank: int, local_rank: int, stream: str = "stderr") -> list[Path]:
        """torchrun's `stream` ("stdout" or "stderr") files of one rank, sorted by path
        (torchrun's own layout: node-<n>/<run>/attempt_<k>/<local rank>/<stream>.log)."""
        return sorted(self.node_logs(node_rank).glob(f"*/attempt_*/{local_rank}/{stream}.log"))

    def rank_file(self, rank: int, suffix: str) -> Path:
        """`rank-<rank><suffix>`, e.g. `rank_file(0, RECORDS)`."""
        return self.root / f"{_RANK_PREFIX}{rank}{suffix}"

    def rank_files(self, suffix: str) -> dict[int, Path]:
        """rank -> its existing `rank-<r><suffix>` file, in rank order."""
        numbered = ((p.name[len(_RANK_PREFIX):-len(suffix)], p) for p in self.root.glob(f"{_RANK_PREFIX}*{suffix}"))
        return dict(sorted((int(number), p) for number, p in numbered if number.isdigit()))

    def records(self, rank: int) -> Path:
        """Rank `rank`'s records (JSON lines)."""
        return self.rank_file(rank, RECORDS)

    def summary(self, rank: int) -> Path:
        """How rank `rank` ended."""
        return self.rank_file(rank, SUMMARY)

    def heartbeat(self, rank: int) -> Path:
        """Rank `rank`'s heartbeat."""
        return self.rank_file(rank, HEARTBEAT)

    def stacks(self, rank: int) -> Path:
        """Rank `rank`'s stack dump."""
        return self.rank_file(rank, STACKS)

    def trace(self, rank: int) -> Path:
        """Rank `rank`'s Chrome trace (--profile)."""
        return self.root / f"trace-rank{rank}.json"

    def memory_snapshot(self, rank: int) -> Path:
        """Rank `rank`'s CUDA memory snapshot (--memory-snapshot)."""
        return self.root / f"memory-rank{rank}.pickle"


class SweepPaths(_Dir):
    """Where each file of the sweep directory `root` lives; each point is a run directory."""

    manifest = _In("sweep.json", "The sweep's manifest: configuration and every point's state.")
    lock = _In("sweep.lock", "Held while a sweep runs in this directory.")
    moved_aside = _In(".attempts", "Where earlier tries of a point are kept, never deleted.")

    def point(self, name: str) -> RunPaths:
        """The run directory of the point `name`."""
        return RunPaths(root=self.root / name)


class TunePaths(_Dir):
    """Where each file of the tune directory `root` lives; each trial is a run directory."""

    owner = _In(OWNER_FILE, "Which dlaunch process claimed the tune dir.")
    record = _In(TUNE_RECORD, "Every trial of the tune: predicted, measured, status, chosen.")
    tuned_plan = _In("tuned-plan.json", "The fastest measured trial's decisions, for `run --plan`.")
    report = _In(REPORT_SUBDIR, "Where `dlaunch report` writes the tune's report by default.")

    def trial(self, name: str) -> RunPaths:
        """The run directory of the trial `name` (`<n>-<candidate>`)."""
        return RunPaths(root=self.root / name)


def new_run_id(workload: str) -> str:
    """`<stem>-<UTC time>-<random>`: sortable, and unique across concurrent launches."""
    stem = _SAFE.sub("-", Path(workload).stem)[:40] or "run"
    return f"{stem}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"


def checkpoint_dir(run_dir: str | Path, env: Mapping[str, str]) -> Path:
    """Where a run's checkpoints go: DLAUNCH_CHECKPOINT_DIR of `env` (made absolute) when set,
    else RUN_DIR/checkpoints. The launcher hands the ranks the answer under the same name."""
    given = env.get(CHECKPOINT_DIR_ENV)
    return Path(given).expanduser().absolute() if given else RunPaths(root=run_dir).checkpoints


def check_checkpoint_dir(path: Path) -> None:
    """LaunchError (one line, what to do) when checkpoints could not be written under `path`:
    judged on the nearest folder that exists, before anything of the run is written."""
    existing = next((a for a in (path, *path.parents) if a.exists()), Path("/"))
    fix = f"set {CHECKPOINT_DIR_ENV} to a writable folder, or drop --checkpoint-every and --max-restarts"
    if not existing.is_dir():
        raise LaunchError(f"cannot write checkpoints to {str(path)!r}: {str(existing)!r} is a file, "
                          f"not a directory; {fix}")
    if not os.access(existing, os.W_OK | os.X_OK):
        read_only = bool(os.statvfs(existing).f_flag & os.ST_RDONLY)
        why = "read-only file system" if read_only else "permission denied"
        raise LaunchError(f"cannot write checkpoints to {str(path)!r}: {why} at {str(existing)!r}; {fix}")


def create_run_dir(path: str | Path | None, run_id: str, *, root: str | Path = "runs") -> Path:
    """Create the run directory (mode 0750, never world-writable) and return its absolute path. An
    explicit path may exist only if it is empty, and the dir is claimed by creating its owner file
    exclusively, so of two runs started at once with one path, one is refused."""
    p = (Path(path) if path is not None else Path(root) / run_id).expanduser().absolute()
    if (blocker := next((a for a in p.parents if a.exists() and not a.is_dir()), None)) is not None:
        raise LaunchError(f"cannot create run dir {str(p)!r}: {str(blocker)!r} is a file, not a "
                          "directory; give a writable --run-dir")
    made = False  # this call made the dir: a failure removes it again (nothing half-made)
    try:
        _make_parents(p)
        try:
            p.mkdir(mode=0o750)
            made = True
        except FileExistsError:
            if not p.is_dir():
                raise LaunchError(f"--run-dir {str(path)!r} exists and is not a directory; "
                                  "give a new directory") from None
            if any(entry.name != OWNER_FILE for entry in p.iterdir()):
                raise LaunchError(f"--run-dir {str(path)!r} already holds a run; "
                                  "give a new or empty directory") from None
        _claim(p, path, run_id)
        os.chmod(p, 0o750)  # an existing empty --run-dir too: never world-writable
    except OSError as e:
        _unmake(p, made)
        why = (f"write to run dir {str(p)!r} (permission denied)" if isinstance(e, PermissionError)
               else f"create run dir {str(p)!r}: {e.strerror}")
        raise LaunchError(f"cannot {why}; give a writable --run-dir") from None
    return p


def _unmake(p: Path, made: bool) -> None:
    """Remove a run dir this launch made before failing to claim it (e.g. a full disk)."""
    if not made:
        return
    try:
        RunPaths(root=p).owner.unlink(missing_ok=True)
        p.rmdir()
    except OSError as e:  # the error being raised says what went wrong; this is tidying
        log.debug("could not remove the half-made run dir %s: %s", p, e)


def _claim(p: Path, given: str | Path | None, run_id: str) -> None:
    """Create the owner file with O_EXCL: the one atomic step that makes the dir this run's."""
    owner = RunPaths(root=p).owner
    try:
        fd = os.open(owner, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
    except FileExistsError:
        try:
            pid = json.loads(owner.read_text(encoding="utf-8")).get("pid")
        except (OSError, ValueError, AttributeError):
            pid = None
        who = f"another dlaunch (pid {pid})" if pid else "another run"
        raise LaunchError(f"--run-dir {str(given if given is not None else p)!r} is taken by {who}; "
                          "give a new directory") from None
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump({"pid": os.getpid(), "host": socket.gethostname(), "time": time.time(), "run_id": run_id}, f)


def _make_parents(p: Path) -> None:
    """mkdir -p of p's parents, each new one 0755 whatever the umask (`runs/` is shared by
    every run; with umask 000 `Path.mkdir(parents=True)` would make it world-writable)."""
    for d in [a for a in reversed(p.parents) if not a.exists()]:
        try:
            d.mkdir(mode=0o755)
        except FileExistsError:  # a concurrent launch made it first
            continue
        os.chmod(d, 0o755)

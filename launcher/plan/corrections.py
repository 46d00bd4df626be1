"""Per-machine corrections of the step-time model, learnt from `dlaunch tune` trials.

A trial's compute ratio is (measured - predicted non-compute terms) / predicted compute: the trials
time whole steps, not their parts, and compute is the term the probe-derived rates get most wrong
on a shared or throttled machine. The trials of one machine (`fingerprint`) and one workload (file
name and arguments: the step probe already times each workload, so a ratio learnt on one model
says nothing about another) give one correction per precision, the median ratio of its trials, by
which `search.plan` scales every candidate's predicted compute; a precision without trials takes
the median of all the workload's (the machine is slower or faster than its probe for every dtype),
so an unmeasured precision never wins on the model's uncorrected optimism alone. A trial more than
TRUSTED_STEP_RATIO off the prediction is not stored: a model that good elsewhere is not that wrong
here, the probe (or the host) was: a probe cached on a busy host once made a tune store 0.31 for an
idle one. Nor are the trials of two tunes at once on one machine (`TuneLock`).

Pure values and JSON files given by path: never imports torch, cli, backends, jobs, runtime or
report; the cache directory is launcher.plan.resolve's.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO

from launcher.errors import PlanError
from launcher.files import atomic_write_json
from launcher.hardware.types import Topology
from launcher.plan.types import StepTimeEstimate
from launcher.specs import check

log = logging.getLogger(__name__)

# bump when the meaning of a stored trial changes, so old files are ignored: a stored ratio is
# measured / predicted, so any change to the CPU or GPU cost model changes its meaning too
CORRECTIONS_FORMAT = 5
# the newest trials kept per precision: old ones describe a machine that may have changed
MAX_TRIALS_PER_PRECISION = 20
# a measured step shorter than the predicted non-compute terms would give a ratio <= 0: the
# communication was overpredicted, not the compute free; the ratio is kept at least this
MIN_COMPUTE_RATIO = 0.1
# measured / predicted step times outside this range are not learnt from (see the docstring)
TRUSTED_STEP_RATIO = (0.5, 2.0)


@dataclass(frozen=True, kw_only=True)
class TrialRecord:
    """One measured tune trial, as the correction cache stores it."""

    precision: str
    compute_ratio: float  # corrected compute / predicted compute
    step_ratio: float  # measured / predicted step time
    predicted_step_s: float
    measured_step_s: float
    workload: str  # the workload file's name
    tune_dir: str
    at: str  # ISO date of the trial
    workload_args: tuple[str, ...] = ()  # its arguments (after `--`)

    @property
    def trusted(self) -> bool:
        """Close enough to the prediction to be a correction, not a symptom (see the docstring)."""
        low, high = TRUSTED_STEP_RATIO
        return low <= self.step_ratio <= high

    def __post_init__(self) -> None:
        for name in ("compute_ratio", "step_ratio", "predicted_step_s", "measured_step_s"):
            check(getattr(self, name) > 0, PlanError, f"tune trial {name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True, kw_only=True)
class Correction:
    """The stored trials of this machine, reduced to one compute factor per precision."""

    factors: Mapping[str, float]  # precision -> median compute ratio
    overall: float  # median compute ratio of every trial: for precisions without trials
    trials: int
    latest: str  # date of the newest trial
    tune_dirs: tuple[str, ...]

    def factor(self, precision: str) -> float:
        """The compute factor of `precision`: its own trials', else every trial's."""
        return self.factors.get(precision, self.overall)

    def describe(self) -> str:
        """'corrected by 3 tune trials (2025-01-02): compute x1.9 for fp32 (runs/tune-...)'."""
        factors = ", ".join([*(f"x{f:.3g} for {p}" for p, f in sorted(self.factors.items())),
                             f"x{self.overall:.3g} for the others"])
        return (f"corrected by {self.trials} tune trial{'s' if self.trials != 1 else ''} "
                f"({self.latest}): predicted compute {factors} (median measured/predicted; "
                f"trials in {', '.join(self.tune_dirs)}; --no-calibration-cache ignores it)")


def fingerprint(topology: Topology, torch_version: str) -> str:
    """The key of this machine's corrections: what the step-time model's rates depend on."""
    what = [topology.device, topology.accelerator.name, topology.num_nodes, topology.devices_per_node,
            topology.intra_node.kind, torch_version, CORRECTIONS_FORMAT]
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:24]


def compute_ratio(predicted: StepTimeEstimate, measured_step_s: float) -> float:
    """What the compute term should have been, over what it was (see the module docstring)."""
    other_s = predicted.step_time_s - predicted.compute_s
    if predicted.compute_s <= 0:
        return 1.0
    return max(MIN_COMPUTE_RATIO, (measured_step_s - other_s) / predicted.compute_s)


def load_trials(path: Path) -> list[TrialRecord]:
    """The trials stored at `path`; none when the file is absent, unreadable or stale."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("format") != CORRECTIONS_FORMAT:
            return []
        return [TrialRecord(**{**t, "workload_args": tuple(t.get("workload_args", ()))}) for t in data["trials"]]
    except (OSError, ValueError, TypeError, KeyError, AttributeError, PlanError) as e:
        log.debug("corrections %s not used: %s", path, e)
        return []


def store_trials(path: Path, new: Sequence[TrialRecord]) -> list[TrialRecord]:
    """Add the trusted ones of `new` to the trials at `path`, keeping the newest MAX_TRIALS_PER_PRECISION
    of each workload and precision; returns those not stored."""
    refused = [t for t in new if not t.trusted]
    for t in refused:
        log.warning("tune trial in %s not learnt from: measured/predicted %.2f is outside %g-%g; "
                    "the probe or the host was off (re-plan on an idle host with "
                    "--no-calibration-cache, then tune again)", t.tune_dir, t.step_ratio,
                    *TRUSTED_STEP_RATIO)
    kept: list[TrialRecord] = []
    trials = [*load_trials(path), *(t for t in new if t.trusted)]
    for key in sorted({(t.workload, t.workload_args, t.precision) for t in trials}):
        kept += [t for t in trials if (t.workload, t.workload_args, t.precision) == key][-MAX_TRIALS_PER_PRECISION:]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, {"format": CORRECTIONS_FORMAT, "trials": [dataclasses.asdict(t) for t in kept]})
    except OSError as e:  # a read-only cache must not fail the tune that measured them
        log.warning("tune trials not stored in %s: %s", path, e)
    return refused


def correction_of(trials: Sequence[TrialRecord], *, workload: str | None = None,
                  workload_args: Sequence[str] = ()) -> Correction | None:
    """The median compute ratio per precision of `trials` (of `workload` with `workload_args`, when given), or None."""
    if workload is not None:
        trials = [t for t in trials if t.workload == workload and t.workload_args == tuple(workload_args)]
    if not trials:
        return None
    factors = {p: statistics.median(t.compute_ratio for t in trials if t.precision == p)
               for p in {t.precision for t in trials}}
    return Correction(factors=factors, overall=statistics.median(t.compute_ratio for t in trials),
                      trials=len(trials), latest=max(t.at for t in trials)[:10],
                      tune_dirs=tuple(dict.fromkeys(t.tune_dir for t in reversed(trials))))


class TuneLock:
    """The machine's tune lock, held while a local tune's trials run: `fcntl.flock` on `path` (in the
    cache dir), taken without waiting, released when the process ends however it ends. A tune that
    finds it held runs anyway but is `contended`, and appends a line to the file, so that the holder
    learns at its end that it is `contended` too. Neither's timings are this machine's: the caller
    stores nothing."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.held = False
        self._file: IO[bytes] | None = None
        self._size = 0

    def __enter__(self) -> TuneLock:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "ab")
        except OSError as e:  # a read-only cache: the trials cannot be stored anyway
            log.debug("tune lock %s not taken: %s", self.path, e)
            return self
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.held = True
            self._size = os.fstat(self._file.fileno()).st_size
        except BlockingIOError:  # another tune holds it: knock, so that it learns of this one
            self._file.write(f"{os.getpid()}\n".encode())
            self._file.flush()
        return self

    @property
    def contended(self) -> bool:
        """Whether another tune ran beside this one (so far)."""
        return self._file is not None and (not self.held or os.fstat(self._file.fileno()).st_size > self._size)

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        if self._file is not None:
            if self.held:
                self._file.truncate(0)  # the knocks were for this holder alone
            self._file.close()  # releases the lock
            self._file = None

"""The few exception types dlaunch raises for problems a user can fix.

Every `DlaunchError` carries a one-line message that says what was wrong, what was given and
how to fix it; the CLI prints that line (no traceback unless `--debug`) and exits with
`exit_code`. Faults inside a run (a rank died) are `JobFailed`, which exits 1, not 2.

Every module imports it, so it never imports any other part of dlaunch.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator


class DlaunchError(Exception):
    """Base class: a problem the user can fix; printed as one line, exit code 2."""

    exit_code: int = 2


class UsageError(DlaunchError):
    """A command-line value is malformed or out of range."""


class WorkloadError(DlaunchError):
    """A workload file is missing, broken, or does not follow the workload contract."""


class TopologyError(DlaunchError):
    """A topology file or detected topology is invalid."""


class ConfigError(DlaunchError):
    """A dlaunch.yaml (or other config file) is invalid."""


class PlanError(DlaunchError):
    """No candidate plan fits, or a requested override is impossible."""


class LaunchError(DlaunchError):
    """The backend cannot start the job (no torchrun, no SLURM, unwritable run dir...)."""


class Refused(LaunchError):
    """The scheduler refused the job itself (sbatch: its partition, account or shape), or it
    could not be submitted from here: every job like it would be refused alike."""


class JobFailed(DlaunchError):
    """The job started but did not finish cleanly (a rank failed, hung or was cancelled)."""

    exit_code = 1


class StorageError(DlaunchError):
    """A file dlaunch writes cannot be written: the disk is full, over quota or read-only."""


class RunDirError(DlaunchError):
    """A run directory's launch.json or result.json is not what dlaunch writes."""


class Interrupted(KeyboardInterrupt):
    """A SIGTERM or SIGHUP to dlaunch, raised where Ctrl-C's KeyboardInterrupt would be (the CLI
    installs the handlers), so that every `finally`, `with` and `except KeyboardInterrupt` that cleans
    up after Ctrl-C does so after these too. Not a DlaunchError: an `except Exception` (a probe that
    fails is "planning without it") must not swallow it. Exits 128 + the signal, as an interrupted run does."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
        self.doing = ""  # what dlaunch was doing (`stopped_while`), the innermost

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def line(self) -> str:
        """'stopped by SIGTERM while planning'."""
        return f"stopped by {signal.Signals(self.signum).name}" + (f" while {self.doing}" if self.doing else "")


@contextlib.contextmanager
def stopped_while(doing: str) -> Iterator[None]:
    """Name what the body does in the line of an `Interrupted` raised inside it."""
    try:
        yield
    except Interrupted as e:
        e.doing = e.doing or doing
        raise

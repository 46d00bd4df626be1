"""The few exception types dlaunch raises for problems a user can fix.

Every `DlaunchError` carries a one-line message that says what was wrong, what was given and
how to fix it; the CLI prints that line (no traceback unless `--debug`) and exits with
`exit_code`. Faults inside a run (a rank died) are `JobFailed`, which exits 1, not 2.

Every module imports it, so it never imports any other part of dlaunch.
"""

from __future__ import annotations


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

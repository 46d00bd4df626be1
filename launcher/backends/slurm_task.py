"""Old import path of the pickled SLURM task, kept so a job queued before the 0.2 upgrade
(its pickle names `launcher.backends.slurm_task.NodeTask`) still unpickles and runs.

Imports `backends.slurm.task` only: it must never grow code of its own.
"""

from launcher.backends.slurm.task import NodeTask

__all__ = ["NodeTask"]

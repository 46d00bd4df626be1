"""The backends dlaunch knows, by name: the registry `select` and `owner_of` look in.

Asked in this order whether a run is theirs (SLURM first: it claims run dirs by their
slurm.json and bare job ids, local claims every other dir). A new backend is a row here.
The CLI reaches the backends only through this module and launcher.backends.base (never
backends.slurm): the option table's `--slurm-opt` check takes `parse_slurm_opts` from here.
Imports the backends only; never results, report, drivers, cli or runtime.
"""

from __future__ import annotations

from launcher.backends.base import Registry
from launcher.backends.host import LocalBackend
from launcher.backends.slurm.backend import SlurmBackend
from launcher.backends.slurm.submit import parse_slurm_opts

BACKENDS: Registry = {"slurm": SlurmBackend(), "local": LocalBackend()}

__all__ = ["BACKENDS", "parse_slurm_opts"]

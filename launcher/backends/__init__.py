"""Backends start processes: `local` (torchrun on this host) and `slurm` (submitit), behind
one interface (`base.Backend`: render, start, follow; status, logs, cancel of a run).

Each renders the exact command before it runs it, so `--dry-run` shows what would run and
tests compare renderings with golden files. Backends never import `launcher.runtime`: they
name its entry module as a string.
"""

RANK_ENTRY_MODULE = "launcher.runtime.entry"

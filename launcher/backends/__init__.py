"""Backends start processes: `local` (torchrun on this host, backends.host) and `slurm`
(submitit, backends.slurm), behind one interface (`base.Backend`: place, render, start ->
Handle.follow -> Ended; status, logs, cancel of a run), listed in `registry`.

Each renders the exact command before it runs it, so `--dry-run` shows what would run and
tests compare renderings with golden files. Backends never import `launcher.runtime` (they
name its entry module as a string), results, report, drivers or cli.
"""

RANK_ENTRY_MODULE = "launcher.runtime.entry"
SCRIPT_BOOTSTRAP_MODULE = "launcher.runtime.bootstrap"  # what a plain script runs under

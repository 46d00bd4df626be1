"""dlaunch: a distributed PyTorch job launcher and scaling harness.

The package follows the data flow, one direction:

    cli -> request -> hardware / plan -> backends -> runtime (inside ranks) -> results -> report

`jobs` follows a job that a backend started (local supervision, sweeps, the lab, SLURM
progress). Shared values live in `specs`, the exception types in `errors`, the run-dir file
names in `rundir`. Importing this package imports nothing else of it and no torch.

It must never import one of its submodules: every `import launcher.x` runs this file first.
"""

__version__ = "0.2.0"

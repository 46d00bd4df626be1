"""Following jobs that a backend started: a local run end to end, SLURM runs, sweeps, the lab.

Never imports cli or runtime (ranks are reached through files only).
"""

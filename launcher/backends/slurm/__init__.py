"""Everything that talks to SLURM: render/submit (submitit), job queries, the per-node task
and progress read from the shared filesystem. Never imports runtime, results, drivers or cli.
"""

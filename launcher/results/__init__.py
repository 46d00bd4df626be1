"""What a run measured: rank files -> `RunResult`, verdicts and the terminal summary table.

Never imports report, jobs, backends, cli or runtime.
"""

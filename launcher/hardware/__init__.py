"""The hardware a job runs on: topology files, detection of this machine, GPU probes, views.

Never imports plan, backends, jobs, runtime, results or report.
"""

"""Scaling reports: a sweep, run or tune directory in, numbers, predictions, plots and pages out.

Reads results (never writes rank files); never imports cli, backends, jobs or runtime.
"""

"""Drivers: every command's launches, on whatever backend runs them. `launch` is the one driver
of a run (launch.json, restarts, aggregation, result.json, the summary); sweeps, the lab, tune
and the doctor launch each of their runs through it. Never imports cli or runtime (ranks are
reached through files only).
"""

"""Planning: profile a workload on the meta device, model memory and step time, pick a strategy.

`memory`, `cost`, `search` and `types` are pure functions of frozen dataclasses (no torch, no
I/O); `profile` imports torch to run the model on meta; `resolve` is the glue to files and
caches. Never imports cli, backends, jobs, runtime or report.
"""

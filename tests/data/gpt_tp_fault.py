"""tests/data/gpt_fault.py (workloads/gpt.py with one injected fault) with gpt's tp_plan, for
the tensor-parallel resume test (tests/integration/test_tensor_parallel.py) and --detect-anomaly
under TP (tests/integration/test_diagnostics.py)."""

from gpt_fault import (  # noqa: F401  (the workload's contract, by name)
    DEFAULTS,
    SAMPLE_UNITS,
    _gpt,
    blocks,
    build_model,
    loss_fn,
    make_dataset,
    units_per_sample,
)


def tp_plan(model, tp):
    return _gpt.tp_plan(model, tp)

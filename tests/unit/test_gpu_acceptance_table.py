"""The GPU acceptance table's own arithmetic: device work summed from a Chrome trace, and the
profiler check failing on a double count."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.gpu_acceptance_table import checks, trace_device_s


def _trace(path: Path) -> Path:
    events = [
        {"ph": "X", "cat": "kernel", "name": "sm90_gemm", "dur": 600.0},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "dur": 100.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 900.0},  # host time: not device
        {"ph": "X", "cat": "user_annotation", "name": "Optimizer.step", "dur": 5000.0},
        {"ph": "i", "cat": "kernel", "name": "instant", "dur": 50.0},  # not a duration event
    ]
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_trace_device_time_counts_kernels_and_copies_only(tmp_path):
    assert trace_device_s(_trace(tmp_path / "t.json")) == 700e-6


def _rows(profile_device_s: float) -> dict:
    base = {"exit": 0, "status": "ok", "step_ratio": None, "failure": "", "compiled": False,
            "graph_breaks": 0}
    return {"profile": {**base, "name": "profile", "top_op": "aten::mm",
                        "profile_device_s": profile_device_s, "trace_device_s": 700e-6}}


def test_profiler_check_fails_on_a_double_count(tmp_path):
    steps = {"inspect": (0, 1.0), "doctor": (0, 1.0), "plan": (0, 1.0)}
    agree = dict((n, ok) for n, ok, _ in checks(_rows(700e-6), steps, tmp_path, "gpu"))
    double = dict((n, ok) for n, ok, _ in checks(_rows(1400e-6), steps, tmp_path, "gpu"))
    key = "profiler device time agrees with the trace's kernels"
    assert agree[key] and not double[key]

"""A run's GPU time by kind of work, from its `--profile` trace, beside the plan's parts.

    python benchmarks/gpu_kernel_split.py RUN_DIR [RUN_DIR ...]

The step-time model (`launcher/plan/cost.py`) splits a step into matmuls, attention,
memory-bound work and the optimizer. This reads the chrome trace `dlaunch run --profile` wrote
(rank 0), sums the device time of its kernels by kind (kernel names: cuBLAS/CUTLASS GEMMs,
flash/memory-efficient attention, NCCL, copies; everything else is memory-bound elementwise and
reduction work, the optimizer's foreach/fused kernels included) per profiled step, and prints
it against the plan's parts for the same step, and scaled so the kinds sum to the median
profiled step (the trace window can hold kernels of the neighbouring steps). Measured, not
modelled: the kernel durations the CUDA profiler recorded.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

KINDS = (
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|sm\d+_.*(tn|nt|nn|tt)|wgmma", re.I)),
    ("communication", re.compile(r"nccl", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor_apply", re.I)),
)


def kind_of(name: str) -> str:
    """The model's kind of work a kernel belongs to (memory-bound when no pattern matches)."""
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "memory-bound"


def split(trace_path: Path, steps: int) -> dict[str, float]:
    """Seconds per profiled step of device time by kind."""
    events = json.loads(trace_path.read_text()).get("traceEvents", [])
    totals: dict[str, float] = {}
    for event in events:
        category = event.get("cat", "")
        if category not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        kind = "copies" if category != "kernel" else kind_of(event.get("name", ""))
        totals[kind] = totals.get(kind, 0.0) + float(event.get("dur", 0.0)) / 1e6 / steps
    return totals


def main(argv: list[str]) -> int:
    for run_dir in map(Path, argv):
        result = json.loads((run_dir / "result.json").read_text())
        plan = json.loads((run_dir / "plan.json").read_text())
        chosen = (plan.get("plan") or plan)["chosen"]
        trace = next(iter(sorted(run_dir.glob("trace-rank0*.json"))), None)
        records = [json.loads(line) for line in (run_dir / "rank-0.jsonl").read_text().splitlines()
                   if '"profiled":true' in line.replace(" ", "")]
        if trace is None or not records:
            print(f"{run_dir}: no profiled steps or no trace")
            continue
        measured = split(trace, len(records))
        step_s = sorted(r["step_time_s"] for r in records)[len(records) // 2]
        print(f"\n{run_dir.name}: {chosen['strategy']['kind']} {chosen['strategy']['precision']} "
              f"compile={chosen['strategy'].get('compile')} micro-batch {chosen['micro_batch']}; "
              f"{len(records)} profiled steps, median {step_s:.4f} s "
              f"(run median {result.get('step_time_median_s', 0):.4f} s)")
        # the trace window can hold kernels of the steps around the profiled ones: the share of
        # each kind is what the window measures, the step's median what it is a share of
        scale = step_s / max(sum(measured.values()), 1e-12)
        print(f"  {'kind':<14}{'predicted s':>12}{'measured s':>12}{'scaled s':>10}")
        parts = dict(chosen["time"]["compute_parts"])
        for kind in sorted(set(parts) | set(measured)):
            pred = parts.get(kind)
            got = measured.get(kind, 0.0)
            print(f"  {kind:<14}{'-' if pred is None else f'{pred:.4f}':>12}{got:>12.4f}"
                  f"{got * scale:>10.4f}")
        print(f"  {'all kernels':<14}{sum(parts.values()):>12.4f}{sum(measured.values()):>12.4f}"
              f"{step_s:>10.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The CPU step-time model against real runs: predicted vs measured median step time per cell.

    .venv/bin/python benchmarks/cpu_truth.py [--workloads mlp gpt resnet] [--strategies ddp
        fsdp_full] [--precisions fp32 bf16] [--ranks 1 2 4] [--micro-batches 1 4 16] [--steps 20]
        [--min-train-s 2] [--repeats 3] [--json FILE]

Each cell is a real `dlaunch run` on this machine (torchrun, gloo) with the strategy and
precision forced, checkpointing off and the micro-batch left to the plan (or forced to each of
`--micro-batches`: how the prediction holds as the micro-batch grows), for `--steps` or as
many more as the plan predicts to take `--min-train-s` (the model predicts the steady state: a
tiny model's first steps run slower and 20 of them are over in 0.1 s); the run plans first
(its plan.json holds the predicted step time, the CPU probe's rates included) and its
result.json carries both numbers in its `prediction` block. FSDP on one rank is run when the
planner accepts it; a refused cell is printed with the reason. The load average is printed
before and after every cell: step times measured on a busy host are slow and noisy, so compare
cells taken at a load below the usable core count. The runs share one cache directory of their
own: the CPU probes run in the first cell that needs them, and no correction stored by an earlier
`dlaunch tune` on this host reaches the predictions. A full grid takes about 10 minutes on an
idle 2-core host. At the end: how many cells are within TARGET, and the 10th and 90th
percentiles of measured/predicted (what plan.interval's CPU_RESIDUALS take).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DLAUNCH = [sys.executable, "-m", "launcher.cli"]
TARGET = 0.25  # every cell's |measured/predicted - 1| should stay within this


def load_average() -> float:
    """The 1-minute load average of this host."""
    return float(Path("/proc/loadavg").read_text(encoding="utf-8").split()[0])


def _env(root: Path) -> dict[str, str]:
    # probes of its own, and no step-time corrections from earlier `dlaunch tune`s on this
    # host: the grid judges the model alone
    return {**os.environ, "PYTHONPATH": str(REPO), "DLAUNCH_CACHE_DIR": str(root.parent / "cache")}


def _forced(micro_batch: int | None) -> list[str]:
    return [] if micro_batch is None else ["--micro-batch", str(micro_batch)]


def percentiles(values: list[float], at: tuple[float, ...]) -> tuple[float, ...]:
    """The `at` percentiles (0-100) of `values`, linear between order statistics (numpy's
    default)."""
    xs = sorted(values)
    out = []
    for q in at:
        pos = (len(xs) - 1) * q / 100
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        out.append(xs[lo] + (pos - lo) * (xs[hi] - xs[lo]))
    return tuple(out)


def cell_steps(workload: str, strategy: str, precision: str, ranks: int, micro_batch: int | None,
               steps: int, min_train_s: float, root: Path) -> int:
    """`steps`, or more where the plan predicts they would train for under `min_train_s`: the
    model predicts the steady state, which a few milliseconds of a tiny model's training have
    not reached (its first steps run 1.3-1.8x slower)."""
    proc = subprocess.run([*DLAUNCH, "plan", str(REPO / "workloads" / f"{workload}.py"), "--gpus",
                           str(ranks), "--strategy", strategy, "--precision", precision,
                           "--checkpointing", "none", *_forced(micro_batch), "--json"], cwd=REPO,
                          capture_output=True,
                          text=True, check=False, env=_env(root))
    try:
        t = json.loads(proc.stdout)["plan"]["chosen"]["time"]
    except (ValueError, KeyError, TypeError):
        return steps  # the run says why
    step_s = t["compute_s"] + t["comm_exposed_s"] + t["contention_s"] + t["sync_wait_s"]
    return max(steps, math.ceil(min_train_s / step_s)) if step_s > 0 else steps


def run_cell(workload: str, strategy: str, precision: str, ranks: int, micro_batch: int | None,
             steps: int, root: Path) -> dict[str, Any]:
    """One `dlaunch run` of the cell; its predicted and measured step times, or why not."""
    run_dir = root / f"{workload}-{strategy}-{precision}-{ranks}-{micro_batch or 'plan'}"
    root.mkdir(parents=True, exist_ok=True)
    cmd = [*DLAUNCH, "run", str(REPO / "workloads" / f"{workload}.py"), "--gpus", str(ranks),
           "--strategy", strategy, "--precision", precision, "--checkpointing", "none",
           *_forced(micro_batch), "--steps", str(steps), "--no-calibrate", "--run-dir",
           str(run_dir), "--force"]
    cell: dict[str, Any] = {"workload": workload, "strategy": strategy, "precision": precision,
                            "ranks": ranks, "steps": steps, "load_before": load_average()}
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False,
                          env=_env(root))
    cell["wall_s"] = round(time.monotonic() - started, 1)
    cell["load_after"] = load_average()
    result_path = run_dir / "result.json"
    if proc.returncode != 0 or not result_path.exists():
        lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        cell["error"] = lines[-1] if lines else f"exit {proc.returncode}"
        return cell
    result = json.loads(result_path.read_text(encoding="utf-8"))
    prediction = result.get("prediction") or {}
    cell["measured_s"] = result.get("step_time_median_s")
    cell["predicted_s"] = prediction.get("step_time_s")
    cell["micro_batch"] = _micro_batch(run_dir)
    if cell["measured_s"] and cell["predicted_s"]:
        cell["ratio"] = cell["measured_s"] / cell["predicted_s"]
    return cell


def _micro_batch(run_dir: Path) -> int | None:
    try:
        launch = json.loads((run_dir / "launch.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return launch.get("micro_batch") or (launch.get("spec") or {}).get("micro_batch")


def combine(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """One cell from its repeated runs: the median measured step time (the prediction is the
    same plan each time), the loads around them, and every run's measurement."""
    ok = [c for c in repeats if "ratio" in c]
    if not ok:
        return repeats[-1]
    cell = dict(ok[0])
    cell["measured_s"] = statistics.median(c["measured_s"] for c in ok)
    cell["predicted_s"] = statistics.median(c["predicted_s"] for c in ok)
    cell["ratio"] = cell["measured_s"] / cell["predicted_s"]
    cell["load_before"] = min(c["load_before"] for c in repeats)
    cell["load_after"] = max(c["load_after"] for c in repeats)
    cell["runs_s"] = [round(c["measured_s"], 5) for c in ok]
    return cell


def format_cell(c: dict[str, Any]) -> str:
    """One row of the grid."""
    head = (f"{c['workload']:<7}{c['strategy']:<10}{c['precision']:<6}{c['ranks']:>3}  "
            f"load {c['load_before']:5.2f} -> {c['load_after']:5.2f}  ")
    if "error" in c:
        return head + f"not run: {c['error']}"
    if "ratio" not in c:
        return head + "no prediction in result.json"
    mark = "ok" if abs(c["ratio"] - 1) <= TARGET else "MISS"
    return head + (f"mb {c.get('micro_batch') or '?':>3}  steps {c.get('steps', '?'):>4}  "
                   f"predicted {c['predicted_s']:8.4f} s  "
                   f"measured {c['measured_s']:8.4f} s  measured/predicted {c['ratio']:5.2f}  {mark}")


def main(argv: list[str] | None = None) -> int:
    """Run the grid, print it with the ratio per cell, and write it as JSON when asked."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", nargs="+", default=["mlp", "gpt", "resnet"])
    ap.add_argument("--strategies", nargs="+", default=["ddp", "fsdp_full"])
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 4])
    ap.add_argument("--micro-batches", nargs="+", type=int, default=[None],
                    help="force each of these micro-batches (default: the plan's choice)")
    ap.add_argument("--steps", type=int, default=20, help="steps per run, at least")
    ap.add_argument("--min-train-s", type=float, default=2.0,
                    help="more steps where the plan predicts the run would train for less")
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs per cell, in alternate passes over the grid; the median counts")
    ap.add_argument("--json", metavar="FILE", help="also write the grid as JSON")
    args = ap.parse_args(argv)
    start_load = Path("/proc/loadavg").read_text(encoding="utf-8").strip()
    print(f"load average before: {start_load}  ({os.cpu_count()} CPUs)", flush=True)
    grid = [(w, s, p, r, mb) for w in args.workloads for s in args.strategies
            for p in args.precisions for r in args.ranks for mb in args.micro_batches]
    runs: dict[tuple[str, str, str, int, int | None], list[dict[str, Any]]] = {k: [] for k in grid}
    with tempfile.TemporaryDirectory(prefix="cpu-truth-") as tmp:
        steps: dict[tuple[str, str, str, int, int | None], int] = {}
        for rep in range(args.repeats):
            # alternate passes: drift in the host's speed hits every cell alike
            for key in grid if rep % 2 == 0 else reversed(grid):
                root = Path(tmp) / f"r{rep}"
                if key not in steps:
                    steps[key] = cell_steps(*key, args.steps, args.min_train_s, root)
                cell = run_cell(*key, steps[key], root)
                runs[key].append(cell)
                print(f"[{rep + 1}/{args.repeats}] " + format_cell(cell), flush=True)
    cells = [combine(runs[key]) for key in grid]
    print("\nmedian of the repeats:")
    for cell in cells:
        print(format_cell(cell))
    end_load = Path("/proc/loadavg").read_text(encoding="utf-8").strip()
    print(f"load average after: {end_load}")
    ratios = [c["ratio"] for c in cells if "ratio" in c]
    within = sum(abs(r - 1) <= TARGET for r in ratios)
    if ratios:
        p10, p90 = percentiles(ratios, (10, 90))
        print(f"{within} of {len(ratios)} cells within {TARGET:.0%}; median measured/predicted "
              f"{statistics.median(ratios):.2f} (10th-90th percentile {p10:.2f}-{p90:.2f}); "
              f"{len(cells) - len(ratios)} cell(s) not run")
    if args.json:
        Path(args.json).write_text(json.dumps({"load_before": start_load, "load_after": end_load,
                                               "cells": cells}, indent=2) + "\n",
                                   encoding="utf-8")
    return 0 if ratios and within == len(ratios) else 1


if __name__ == "__main__":
    sys.exit(main())

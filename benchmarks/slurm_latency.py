"""Submit-to-first-step and submit-to-result of `dlaunch run --slurm` against a running cluster.

    scripts/slurm-cluster.sh up
    python benchmarks/slurm_latency.py                    # 1x2, 2x1, 2x2, 3 runs each
    python benchmarks/slurm_latency.py --repeats 5 --shapes 2x2 --json

Each run is the real CLI (workloads/mlp.py, 5 steps, --no-calibrate, one thread per rank) in a
scratch directory; the numbers come from RUN_DIR/slurm.json, which the launcher writes:
submit time (just before sbatch) to the end of the earliest first step of any rank, and to the
moment the launcher had the aggregated result. Runs are sequential (one job at a time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from launcher.rundir import RunPaths

REPO = Path(__file__).resolve().parents[1]


def one_run(nodes: int, procs: int, workdir: Path, steps: int) -> dict[str, float]:
    """One `dlaunch run --slurm`; its timings from slurm.json."""
    run_dir = workdir / f"run-{nodes}x{procs}-{time.monotonic_ns()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(workdir)}
    argv = [sys.executable, "-m", "launcher.cli.main", "run", str(REPO / "workloads" / "mlp.py"), "--slurm",
            "--nodes", str(nodes), "--gpus", str(procs), "--steps", str(steps), "--no-calibrate",
            "--strategy", "ddp", "--precision", "fp32", "--micro-batch", "8",
            "--run-dir", str(run_dir), "--json"]
    proc = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise SystemExit(f"{nodes}x{procs} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    final = json.loads(RunPaths(root=run_dir).slurm.read_text())["final"]
    return {"first_step_s": final["submit_to_first_step_s"], "result_s": final["submit_to_result_s"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x2,2x1,2x2", help="NODESxPROCS list")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if subprocess.run(["scontrol", "ping"], capture_output=True).returncode != 0:
        print("slurm_latency: no SLURM controller answers; start scripts/slurm-cluster.sh up", file=sys.stderr)
        return 2
    out: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory(prefix="dlaunch-slurm-latency-") as tmp:
        for shape in args.shapes.split(","):
            nodes, procs = (int(x) for x in shape.split("x"))
            runs = [one_run(nodes, procs, Path(tmp), args.steps) for _ in range(args.repeats)]
            out[shape] = {
                "first_step_s": [round(r["first_step_s"], 2) for r in runs],
                "result_s": [round(r["result_s"], 2) for r in runs],
                "median_first_step_s": round(statistics.median(r["first_step_s"] for r in runs), 2),
                "median_result_s": round(statistics.median(r["result_s"] for r in runs), 2),
            }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{'shape':6} {'submit->first step (median)':>28} {'submit->result (median)':>24}  runs")
    for shape, d in out.items():
        print(f"{shape:6} {d['median_first_step_s']:>26.2f} s {d['median_result_s']:>22.2f} s  "
              f"first {d['first_step_s']} result {d['result_s']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

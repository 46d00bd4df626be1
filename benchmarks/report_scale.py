"""`dlaunch report` over a generated run of 4,096 ranks x 200 steps (target: < 10 s).

    .venv/bin/python benchmarks/report_scale.py [--ranks 4096] [--steps 200] [--repeats 3]

Generates the rank files (the harness's exact format, 8 ranks per node, one slow rank) plus
result.json, as a finished run leaves them, then times (a) `write_report` in this process and
(b) the whole `dlaunch report RUN_DIR` command in a fresh process (interpreter start, imports,
matplotlib). Medians over repeats; the page must stay readable (<= 64 boxes, size printed).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from launcher.report.render import render_report  # noqa: E402
from launcher.rundir import RunPaths  # noqa: E402

from tests.synthetic import write_run  # noqa: E402


def cli_argv() -> list[str]:
    """The `dlaunch report` command line, in a fresh interpreter."""
    return [sys.executable, "-m", "launcher.cli.main", "report"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--keep", default=None, help="generate into this directory and keep it")
    args = ap.parse_args()
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="report-scale-"))
    run = root / "run"
    try:
        t0 = time.perf_counter()
        if not RunPaths(root=run).result.exists():
            write_run(run, world_size=args.ranks, steps=args.steps, warmup=3, ranks_per_node=8,
                      jitter=0.2, exposed_comm_s=0.02, busbw_gb_s=40.0, slow={1234: 1.3},
                      result="direct")
        print(f"generated {args.ranks} ranks x {args.steps} steps in "
              f"{time.perf_counter() - t0:.1f} s ({run})", flush=True)
        inproc, cli = [], []
        for _ in range(args.repeats):
            t = time.perf_counter()
            files, rep = render_report(run, with_prediction=False)
            inproc.append(time.perf_counter() - t)
            t = time.perf_counter()
            subprocess.run([*cli_argv(), str(run), "--no-predict"], cwd=REPO, check=True,
                           capture_output=True, env={**os.environ, "PYTHONPATH": str(REPO)})
            cli.append(time.perf_counter() - t)
        html = run / "report" / "report.html"
        groups = len(rep.points[0].distribution["groups"])
        print(f"write_report (in process): median {statistics.median(inproc):.2f} s "
              f"(runs: {', '.join(f'{x:.2f}' for x in inproc)})")
        print(f"dlaunch report (command):  median {statistics.median(cli):.2f} s "
              f"(runs: {', '.join(f'{x:.2f}' for x in cli)}); target < 10 s")
        print(f"page: {html.stat().st_size / 1e3:.0f} kB, {groups} boxes "
              f"({rep.points[0].distribution['caption']}), {len(files)} files, stragglers "
              f"{[s['rank'] for s in rep.points[0].stragglers]}")
        return 0 if statistics.median(cli) < 10 else 1
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

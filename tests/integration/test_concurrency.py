"""Many launches on one host at once: four `dlaunch run` and two `dlaunch scale` started in the
same moment must all succeed, each in its own run dir (no shared port, no shared directory).

Twenty-odd processes on a few cores: slow but must be correct. OMP_NUM_THREADS=1 keeps the ranks from
fighting over threads; the planner's profile cache is warmed once first so that the launchers
do not all import torch to profile the same MLP.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.rundir import RECORDS, RunPaths

from tests.helpers import REPO, run_result, seeded_cache

pytestmark = pytest.mark.distributed

RUNS = 4
TIMEOUT_S = 420


def _env(tmp: Path) -> dict[str, str]:
    env = {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1",
           "DLAUNCH_CACHE_DIR": str(seeded_cache(tmp / "cache")), "PYTHONPATH": str(REPO)}
    env.pop("DLAUNCH_DEBUG", None)
    return env


def test_four_runs_and_two_sweeps_at_once(tmp_path: Path):
    env = _env(tmp_path)
    mlp = str(REPO / "workloads" / "mlp.py")
    warm = subprocess.run([sys.executable, "-m", "launcher.cli.main", "run", mlp, "--gpus", "2",
                           "--dry-run"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert warm.returncode == 0, warm.stderr
    assert not (tmp_path / "runs").exists()  # a dry run writes no run dir
    run = [sys.executable, "-m", "launcher.cli.main", "run", mlp, "--gpus", "2", "--steps", "3",
           "--no-calibrate", "--json"]
    scale = [sys.executable, "-m", "launcher.cli.main", "scale", mlp, "--gpus", "1,2",
             "--steps", "3", "--no-report", "--json"]
    procs = [subprocess.Popen(run, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(RUNS)]
    procs += [subprocess.Popen([*scale, "--sweep-dir", str(tmp_path / f"sweep-{k}")], cwd=tmp_path,
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for k in range(2)]
    t0 = time.monotonic()
    outs = [p.communicate(timeout=max(1.0, TIMEOUT_S - (time.monotonic() - t0))) for p in procs]
    codes = [p.returncode for p in procs]
    assert codes == [0] * len(procs), [(c, o[1][-1500:]) for c, o in zip(codes, outs) if c]
    results = [json.loads(o[0]) for o in outs[:RUNS]]
    dirs = {r["run_dir"] for r in results}
    assert len(dirs) == RUNS and all(Path(d).parent == tmp_path / "runs" for d in dirs)
    assert all(r["status"] == "ok" and [x["steps"] for x in r["ranks"]] == [3, 3] for r in results)
    sweeps = [json.loads(o[0]) for o in outs[RUNS:]]
    point_dirs = [Path(s["sweep_dir"]) / p["name"] for s in sweeps for p in s["points"]]
    assert all(p["status"] == "ok" for s in sweeps for p in s["points"])
    assert len({str(d) for d in point_dirs}) == 4
    # every run (and sweep point) rendezvoused on a port of its own: no run saw another's ranks
    for d in [*map(Path, dirs), *point_dirs]:
        world = run_result(d)["world_size"]
        paths = RunPaths(root=d)
        assert {p for p in d.iterdir() if p.name.endswith(RECORDS)} == {paths.records(r) for r in range(world)}

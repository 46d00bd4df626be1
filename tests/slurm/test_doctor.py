"""`dlaunch doctor --slurm` against the real local cluster (scripts/slurm-cluster.sh): one job of
one torchrun per node, a rank slowed by the test hook named with its node, the ready --exclude
value, and that value, given back as --slurm-opt, keeping the job off that node.

One rank per node: the two fake nodes share this host's two cores, and four ranks time-sharing
them measured up to 25% below the median without any hook (two do not)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.runtime.doctor_checks import SLOW_RANK_ENV

from tests.helpers import Done, run_dlaunch

pytestmark = pytest.mark.slurm


@pytest.fixture
def sl(slurm_cluster, tmp_path: Path):
    """`sl(*args)`: dlaunch in tmp_path with one thread per rank (the two fake nodes share two
    cores) and TMPDIR inside the test dir; sbatch exports this environment to the job."""
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    slurm_cluster.wait_idle()

    def call(*args: str, env: dict[str, str] | None = None) -> Done:
        return run_dlaunch(*args, cwd=tmp_path, env={"TMPDIR": str(tmp), "OMP_NUM_THREADS": "1",
                                                     **(env or {})})

    return call


def test_doctor_names_the_slow_node_and_its_exclude_value_works(sl, tmp_path: Path):
    run_dir = tmp_path / "doc"
    done = sl("doctor", "--slurm", "--nodes", "2", "--gpus-per-node", "1", "--run-dir", str(run_dir),
              env={SLOW_RANK_ENV: "1"})
    assert done.code == 1, (done.out, done.err)
    report = json.loads((run_dir / "doctor.json").read_text())
    assert report["slow_ranks"] == [1] and report["ok"] is False
    host = report["ranks"][1]["host"]
    assert host in ("n1", "n2") and report["exclude"] == host
    assert {r["host"] for r in report["ranks"]} == {"n1", "n2"}
    assert [n["host"] for n in report["nodes"] if n["bad"]] == [host]
    assert report["allreduce_world"]["measured"] > 0  # one rank per node: only across nodes
    assert f"SLOW: rank 1 (cpu on {host}" in done.out
    assert f"exclude: --exclude={host}" in done.out
    assert "expected: nothing: no --topology" in done.out

    # the printed value, handed back, keeps the next job off that node
    again = tmp_path / "again"
    done = sl("doctor", "--slurm", "--nodes", "1", "--gpus-per-node", "1", "--slurm-opt",
              f"exclude={host}", "--topology", "cpu-local", "--run-dir", str(again))
    assert done.code == 0, (done.out, done.err)
    report = json.loads((again / "doctor.json").read_text())
    assert {r["host"] for r in report["ranks"]} == {"n1", "n2"} - {host}
    assert report["expected"]["gemm"]["source"] and "topology cpu-local" in report["expected_from"]

"""`dlaunch scale`: a real sweep (torchrun, gloo), resuming, failures recorded, bad input.

The real runs use the smallest MLP for a few steps; the bookkeeping cases run each point
through a fake `run` that writes a result.json the way the driver does.
"""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path

import pytest

from launcher.backends.base import point_shapes
from launcher.drivers.sweep import Sweep, run_sweep
from launcher.drivers.sweeppoints import SweepInterrupted
from launcher.errors import LaunchError, UsageError
from launcher.files import atomic_write_json, read_json
from launcher.results.types import RunResult
from launcher.rundir import RunPaths, SweepPaths
from launcher.runspec import LaunchSpec

from tests.helpers import DATA, WORKLOADS, assert_one_line_error

MLP = str(WORKLOADS / "mlp.py")
TINY = ["--features", "32", "--hidden", "32", "--depth", "1"]


@pytest.mark.distributed
def test_real_sweep_then_resume_runs_only_the_missing_point(dlaunch, tmp_path):
    sweep = tmp_path / "sweep"
    paths = SweepPaths(root=sweep)
    args = ("scale", MLP, "--gpus", "1,2", "--steps", "6", "--sweep-dir", str(sweep), "--", *TINY)
    done = dlaunch(*args)
    assert done.code == 0, done.err[-3000:]
    manifest = read_json(paths.manifest)
    assert [(p["name"], p["status"], p["attempts"]) for p in manifest["points"]] == [
        ("ws1-r0", "ok", 1), ("ws2-r0", "ok", 1)]
    assert manifest["topology"]["device"] == "cpu"
    report = sweep / "report"
    for name in ("report.html", "report.json", "report.md", "throughput.png", "efficiency.png",
                 "breakdown.png", "ranks.png", "predicted.png"):
        assert (report / name).stat().st_size > 0, name
    numbers = json.loads((report / "report.json").read_text())
    assert [r["world_size"] for r in numbers["rows"]] == [1, 2]
    assert numbers["rows"][0]["efficiency"] == pytest.approx(1.0)
    assert numbers["rows"][1]["efficiency"] > 0
    assert numbers["points"][1]["exposed_comm_s"] is not None
    assert numbers["points"][1]["busbw_gb_s"] > 0
    assert "report: " in done.out and "efficiency" in done.out
    assert "2/2 points" in done.err  # the progress bar
    # one prediction per point: the plan at its shape, kept beside it, is what its summary and
    # the report show; the plan line of the sweep is the largest point's
    for row, name in zip(numbers["rows"], ("ws1-r0", "ws2-r0")):
        planned = read_json(sweep / name / "plan.json")["plan"]
        assert planned["world_size"] == row["world_size"]
        assert row["predicted_step_time_s"] == pytest.approx(planned["step_interval"]["step_time_s"])
    assert "prediction: not available" not in done.out and done.out.count("prediction vs measured (plan.json)") == 2
    headline = re.search(r"predicted ([\d.]+) s/step", done.err)
    assert headline and float(headline.group(1)) == pytest.approx(numbers["rows"][1]["predicted_step_time_s"], rel=0.01)

    # interrupted while the second point ran: its directory is half done (no result.json)
    first = paths.point("ws1-r0").result.stat().st_mtime_ns
    paths.point("ws2-r0").result.unlink()
    again = dlaunch(*args[:-len(TINY) - 1], "--no-report", "--", *TINY)
    assert again.code == 0, again.err[-3000:]
    assert "ws1-r0: ok (already done, skipped" in again.err
    assert "ws2-r0: moved what a previous attempt left to .attempts/" in again.err
    assert paths.point("ws1-r0").result.stat().st_mtime_ns == first
    manifest = read_json(paths.manifest)
    assert [(p["name"], p["status"], p["attempts"]) for p in manifest["points"]] == [
        ("ws1-r0", "ok", 1), ("ws2-r0", "ok", 2)]
    assert len(list(paths.moved_aside.iterdir())) == 1
    assert not paths.lock.exists()


class FakeLauncher:
    """A point's `run` that records what it was asked and writes a result like the driver."""

    def __init__(self, fail: set[int] = frozenset(), raise_at: set[int] = frozenset(),
                 interrupt_at: int | None = None) -> None:
        self.calls: list[LaunchSpec] = []
        self.fail, self.raise_at, self.interrupt_at = fail, raise_at, interrupt_at

    def __call__(self, spec: LaunchSpec, console: io.TextIOBase) -> RunResult:
        self.calls.append(spec)
        n = spec.world_size
        if n == self.interrupt_at:
            raise KeyboardInterrupt
        if n in self.raise_at:
            raise OSError("torchrun vanished")
        ok = n not in self.fail
        result = RunResult(
            run_id=spec.run_id, run_dir=spec.run_dir, workload=spec.workload, world_size=n,
            num_nodes=1, device="cpu", strategy="ddp", precision="fp32",
            status="ok" if ok else "failed", exit_code=0 if ok else 1, wall_time_s=1.0,
            samples_per_s=100.0 * n, units_per_s=100.0 * n, sample_units="samples",
            step_time_median_s=0.08, slowest_rank=0, data_wait_share=0.0, ranks=(),
            failures=() if ok else (f"rank 1 failed after 3 steps: boom at world size {n}",))
        atomic_write_json(RunPaths(root=spec.run_dir).result, result.to_dict())
        console.write("fake run\n")
        return result


def make_sweep(sizes, *, steps: int = 5, mode: str = "weak", global_batch: int | None = None,
               micro_batch: int = 8, repeats: int = 1, processes_per_node: int | None = None) -> Sweep:
    """The sweep `dlaunch scale` would build: a template spec and each world size's shape."""
    template = LaunchSpec(workload=MLP, run_id="", run_dir="", steps=steps, warmup_steps=1,
                          micro_batch=micro_batch)
    return Sweep(template=template, shapes=point_shapes(sorted(set(sizes)), processes_per_node),
                 mode=mode, repeats=repeats, global_batch=global_batch, per_node=processes_per_node)


def sweep(tmp_path: Path, launcher, sizes=(1, 2, 4), **kw):
    return run_sweep(make_sweep(sizes, **kw), sweep_dir=tmp_path / "sw", run=launcher,
                     progress=io.StringIO())


def test_failed_point_is_recorded_and_the_sweep_goes_on(tmp_path):
    fake = FakeLauncher(fail={2}, raise_at={4})
    result = sweep(tmp_path, fake, sizes=(1, 2, 4, 8))
    assert [s.world_size for s in fake.calls] == [1, 2, 4, 8]
    status = {p.name: (p.status, p.error) for p in result.points}
    assert status["ws1-r0"] == ("ok", None)
    assert status["ws2-r0"][0] == "failed" and "boom at world size 2" in status["ws2-r0"][1]
    assert status["ws4-r0"] == ("failed", "OSError: torchrun vanished")
    assert status["ws8-r0"] == ("ok", None)
    assert not result.ok and [p.name for p in result.failed] == ["ws2-r0", "ws4-r0"]
    manifest = read_json(SweepPaths(root=tmp_path / "sw").manifest)
    assert [p["status"] for p in manifest["points"]] == ["ok", "failed", "failed", "ok"]
    # the next call retries only the failed points
    retry = FakeLauncher()
    result = sweep(tmp_path, retry, sizes=(1, 2, 4, 8))
    assert [s.world_size for s in retry.calls] == [2, 4]
    assert result.ok and (result.ran, result.skipped) == (2, 2)
    # and the report still covers everything, failures named
    from launcher.report.scaling import build_report

    rep = build_report(tmp_path / "sw", with_prediction=False)
    assert [r.world_size for r in rep.rows] == [1, 2, 4, 8]


def test_interrupt_leaves_the_point_pending_and_resume_runs_it(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        sweep(tmp_path, FakeLauncher(interrupt_at=2))
    manifest = read_json(SweepPaths(root=tmp_path / "sw").manifest)
    assert [(p["name"], p["status"]) for p in manifest["points"]] == [
        ("ws1-r0", "ok"), ("ws2-r0", "pending"), ("ws4-r0", "pending")]
    assert not SweepPaths(root=tmp_path / "sw").lock.exists()
    again = FakeLauncher()
    sweep(tmp_path, again)
    assert [s.world_size for s in again.calls] == [2, 4]
    assert SweepPaths(root=tmp_path / "sw").moved_aside.is_dir()  # ws2's half-done dir was kept


def test_strong_scaling_splits_the_global_batch_and_repeats(tmp_path):
    fake = FakeLauncher()
    result = sweep(tmp_path, fake, mode="strong", global_batch=16, micro_batch=1, repeats=2)
    assert [(s.world_size, s.micro_batch, s.global_batch) for s in fake.calls] == [
        (1, 16, 16), (1, 16, 16), (2, 8, 16), (2, 8, 16), (4, 4, 16), (4, 4, 16)]
    assert [p.name for p in result.points] == ["ws1-r0", "ws1-r1", "ws2-r0", "ws2-r1",
                                               "ws4-r0", "ws4-r1"]
    assert len({s.run_id for s in fake.calls}) == 6
    with pytest.raises(UsageError, match="does not split"):
        sweep(tmp_path, fake, sizes=(1, 3), mode="strong", global_batch=16)


def test_points_beyond_one_node_fill_whole_nodes(tmp_path):
    # a launcher that starts several nodes (SLURM) gets each point's node shape
    fake = FakeLauncher()
    result = sweep(tmp_path, fake, sizes=(1, 2, 4, 8), processes_per_node=2)
    assert [(s.nodes, s.gpus) for s in fake.calls] == [(1, 1), (1, 2), (2, 2), (4, 2)]
    assert [p.num_nodes for p in result.points] == [1, 1, 2, 4]
    assert [p["num_nodes"] for p in read_json(SweepPaths(root=tmp_path / "sw").manifest)["points"]] == [1, 1, 2, 4]
    # the same sweep on one host is another configuration: it never resumes into this one
    with pytest.raises(UsageError, match="another configuration"):
        sweep(tmp_path, FakeLauncher(), sizes=(1, 2))
    with pytest.raises(UsageError, match="world size 3 does not fill whole nodes of 2"):
        sweep(tmp_path / "other", FakeLauncher(), sizes=(1, 3), processes_per_node=2)


def test_other_configuration_needs_force(tmp_path):
    sweep(tmp_path, FakeLauncher(), sizes=(1, 2))
    with pytest.raises(UsageError, match="another configuration .*steps: 5 before, 7 now"):
        run_sweep(make_sweep([1, 2], steps=7), sweep_dir=tmp_path / "sw", run=FakeLauncher(),
                  progress=None)
    forced = FakeLauncher()
    run_sweep(make_sweep([1, 2], steps=7), sweep_dir=tmp_path / "sw", run=forced, progress=None,
              force=True)
    assert [s.world_size for s in forced.calls] == [1, 2]
    # growing the sweep reuses the finished points
    more = FakeLauncher()
    run_sweep(make_sweep([1, 2, 4], steps=7), sweep_dir=tmp_path / "sw", run=more, progress=None)
    assert [s.world_size for s in more.calls] == [4]


def test_a_running_sweep_holds_the_directory(tmp_path):
    (tmp_path / "sw").mkdir()
    lock = SweepPaths(root=tmp_path / "sw").lock
    lock.write_text(json.dumps({"pid": os.getpid(), "host": __import__("socket").gethostname()}))
    with pytest.raises(LaunchError, match="another dlaunch scale"):
        sweep(tmp_path, FakeLauncher())
    lock.write_text(json.dumps({"pid": 2**22 + 12345, "host": "x"}))
    sweep(tmp_path, FakeLauncher())  # a lock from elsewhere / a dead process is taken over


def test_signal_stopped_point_interrupts_the_sweep(tmp_path):
    def stopped(spec, out):
        RunPaths(root=spec.run_dir).torchrun_log.write_text(
            "torch.distributed.elastic.multiprocessing.api.SignalException: Process 1 got signal: 15\n")
        return RunResult(run_id=spec.run_id, run_dir=spec.run_dir, workload=spec.workload,
                         world_size=1, num_nodes=1, device="cpu", strategy="ddp",
                         precision="fp32", status="failed", exit_code=1, wall_time_s=1.0,
                         samples_per_s=0.0, units_per_s=0.0, sample_units="samples",
                         step_time_median_s=0.0, slowest_rank=None, data_wait_share=0.0, ranks=())

    with pytest.raises(SweepInterrupted, match="run the same command again") as stopped_by:
        sweep(tmp_path, stopped, sizes=(1,))
    assert stopped_by.value.exit_code == 143  # 128 + SIGTERM, as `dlaunch run` exits
    assert read_json(SweepPaths(root=tmp_path / "sw").manifest)["points"][0]["status"] == "pending"


@pytest.mark.parametrize("gpus,needle", [
    ("1,,2", "item 2 is empty"),
    ("0,2", "world sizes must be >= 1, got 0"),
    ("1,99", "world size 99 is more than the"),
    ("a,b", "'a' is not an integer"),
])
def test_bad_world_sizes_are_one_line_errors(dlaunch, tmp_path, gpus, needle):
    done = dlaunch("scale", MLP, "--gpus", gpus, "--sweep-dir", str(tmp_path / "sw"))
    assert_one_line_error(done, "--gpus", needle)
    assert not (tmp_path / "sw").exists()


def test_dry_run_lists_points_and_runs_nothing(dlaunch, tmp_path):
    done = dlaunch("scale", MLP, "--gpus", "1,2,4", "--mode", "strong", "--global-batch", "32",
                   "--sweep-dir", str(tmp_path / "sw"), "--dry-run")
    assert done.code == 0, done.err
    assert "ws4-r0: 4 rank(s) = 1 node(s) x 4, micro-batch 8, global batch 32" in done.out
    assert not (tmp_path / "sw").exists()


@pytest.mark.distributed
def test_sigterm_to_scale_exits_143_like_run_and_leaves_the_point_pending(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    from tests.helpers import REPO, assert_processes_gone, rank_pids

    sweep = tmp_path / "sweep"
    point = SweepPaths(root=sweep).point("ws1-r0")
    env = {**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "launcher.cli.main", "scale", MLP, "--gpus", "1", "--steps", "100000",
         "--sweep-dir", str(sweep), "--no-report", "--", *TINY],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    records = point.rank_file(0, ".jsonl")
    while time.monotonic() < deadline and not records.exists():
        time.sleep(0.5)
    assert records.exists(), "the point never started"
    time.sleep(2)  # a few steps in
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-3000:]
    assert "run the same command again to resume" in err and "Traceback" not in err
    assert read_json(SweepPaths(root=sweep).manifest)["points"][0]["status"] == "pending"
    assert_processes_gone(rank_pids(point.root))


def test_a_sweep_dir_of_the_old_knob_names_resumes(tmp_path):
    # a manifest written before the knobs were renamed (nested strategy, grad_accum_steps,
    # calibrate_comm): read in today's names, its configuration is this sweep's
    sweep(tmp_path, FakeLauncher(), sizes=(1, 2))
    path = SweepPaths(root=tmp_path / "sw").manifest
    manifest = read_json(path)
    spec = manifest["config"]["spec"]
    old = {k: v for k, v in spec.items() if k not in ("strategy", "precision", "checkpointing", "compile",
                                                     "grad_accum", "calibrate")}
    old.update(grad_accum_steps=spec["grad_accum"], calibrate_comm=spec["calibrate"],
               strategy={"kind": spec["strategy"], "precision": spec["precision"],
                         "activation_checkpointing": spec["checkpointing"] != "none", "compile": spec["compile"]})
    atomic_write_json(path, {**manifest, "config": {**manifest["config"], "spec": old}})
    more = FakeLauncher()
    sweep(tmp_path, more, sizes=(1, 2, 4))  # no "another configuration": only the new point runs
    assert [s.world_size for s in more.calls] == [4]


def test_a_weak_sweep_of_a_plain_torchrun_script_draws_its_curve(dlaunch, tmp_path):
    """The script runs unchanged at each world size (its own batch per rank: weak scaling);
    the bootstrap measures every point, so the report has a throughput per size."""
    sweep = tmp_path / "sweep"
    done = dlaunch("scale", str(DATA / "ddp_argparse.py"), "--gpus", "1,2", "--sweep-dir", str(sweep),
                   "--", "--steps", "12")
    assert done.code == 0, done.err[-3000:]
    assert re.search(r"1 rank\(s\): [\d,.]+ samples/s, efficiency 100%", done.out), done.out
    assert re.search(r"2 rank\(s\): [\d,.]+ samples/s, efficiency \d+%", done.out), done.out
    points = read_json(sweep / "report" / "report.json")["points"]
    assert [p["world_size"] for p in points] == [1, 2] and all(p["samples_per_s"] > 0 for p in points)
    assert (sweep / "report" / "efficiency.png").stat().st_size > 0

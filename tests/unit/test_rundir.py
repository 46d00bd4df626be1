"""The run-dir protocol: every name `RunPaths` / `SweepPaths` gives is the one runs have always
been written under (old run dirs must keep reading), listed here as literals on purpose."""

from __future__ import annotations

from pathlib import Path

from launcher.rundir import HEARTBEAT, RECORDS, STACKS, SUMMARY, RunPaths, SweepPaths

ROOT = Path("/runs/r")

# every name relative to the run dir, exactly as earlier dlaunch versions wrote it
HISTORICAL = {
    "launch": "launch.json",
    "result": "result.json",
    "plan": "plan.json",
    "slurm": "slurm.json",
    "submitit": "slurm",
    "attempts_record": "attempts.json",
    "attempts": "attempts",
    "lab": "lab.json",
    "torchrun_log": "torchrun.log",
    "console_log": "console.log",
    "logs": "logs",
    "checkpoints": "checkpoints",
}
HISTORICAL_PER_RANK = {
    "records": "rank-{rank}.jsonl",
    "summary": "rank-{rank}.summary.json",
    "heartbeat": "rank-{rank}.heartbeat",
    "stacks": "rank-{rank}.stacks",
    "trace": "trace-rank{rank}.json",
    "memory_snapshot": "memory-rank{rank}.pickle",
}


def test_run_dir_names_are_the_historical_ones():
    paths = RunPaths(root=ROOT)
    for attr, name in HISTORICAL.items():
        assert getattr(paths, attr) == ROOT / name, attr
    for method, pattern in HISTORICAL_PER_RANK.items():
        for rank in (0, 7, 4095):
            assert getattr(paths, method)(rank) == ROOT / pattern.format(rank=rank), (method, rank)
    assert paths.node_logs(3) == ROOT / "logs" / "node-3"
    assert paths.attempt(2).result == ROOT / "attempts" / "2" / "result.json"


def test_sweep_dir_names_are_the_historical_ones():
    paths = SweepPaths(root=ROOT)
    assert paths.manifest == ROOT / "sweep.json"
    assert paths.lock == ROOT / "sweep.lock"
    assert paths.moved_aside == ROOT / ".attempts"
    assert paths.point("ws4-r1").records(0) == ROOT / "ws4-r1" / "rank-0.jsonl"


def test_rank_files_finds_existing_files_by_rank_and_ignores_other_names(tmp_path):
    paths = RunPaths(root=str(tmp_path))  # a str root works too
    for name in ("rank-10.jsonl", "rank-2.jsonl", "rank-2.summary.json", "rank-0.heartbeat",
                 "rank-x.heartbeat", "rank-1.stacks", "rank-.jsonl"):
        (tmp_path / name).write_text("")
    assert paths.rank_files(RECORDS) == {2: tmp_path / "rank-2.jsonl", 10: tmp_path / "rank-10.jsonl"}
    assert list(paths.rank_files(RECORDS)) == [2, 10]  # in rank order, not name order
    assert paths.rank_files(SUMMARY) == {2: tmp_path / "rank-2.summary.json"}
    assert paths.rank_files(HEARTBEAT) == {0: tmp_path / "rank-0.heartbeat"}
    assert sorted(p.name for p in paths.attempt_files()) == [
        "rank-0.heartbeat", "rank-1.stacks", "rank-10.jsonl", "rank-2.jsonl", "rank-2.summary.json"]
    assert paths.rank_files(STACKS) == {1: tmp_path / "rank-1.stacks"}


def test_node_records_and_rank_logs_follow_torchruns_layout(tmp_path):
    paths = RunPaths(root=tmp_path)
    for node in (1, 0):
        (paths.node_logs(node)).mkdir(parents=True)
        (paths.node_logs(node) / "node.json").write_text("{}")
    log = paths.node_logs(1) / "job_abc" / "attempt_0" / "2" / "stderr.log"
    log.parent.mkdir(parents=True)
    log.write_text("boom\n")
    assert paths.node_records() == [paths.node_logs(0) / "node.json", paths.node_logs(1) / "node.json"]
    assert paths.rank_logs(1, 2) == [log]
    assert paths.rank_logs(1, 2, "stdout") == [] and paths.rank_logs(0, 2) == []

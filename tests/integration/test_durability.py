"""Durability and hygiene of what dlaunch writes: atomic files, whole lines, cut-off rank files
read up to their last whole record, results that never change when re-read, run dirs that are
not world-writable, secrets that never reach a file or the screen, no shell / no yaml.load."""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from pathlib import Path

import pytest

import launcher.files as files
from launcher.backends import local
from launcher.backends.host import LocalRendered
from launcher.errors import StorageError
from launcher.files import append_lines, atomic_write_text, read_jsonl
from launcher.results.aggregate import aggregate
from launcher.rundir import RunPaths, create_run_dir
from launcher.runspec import LaunchSpec
from launcher.runtime.recorder import RankRecorder
from launcher.secrets import MASK, is_secret_name, mask_env, masked_spec_dict

from tests.helpers import REPO, run_dlaunch
from tests.synthetic import write_run


def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_rank_file_cut_mid_line_is_read_up_to_its_last_whole_record(tmp_path):
    run = write_run(tmp_path / "run", world_size=2, steps=10, warmup=2, result=None)
    path = RunPaths(root=run).records(1)
    text = path.read_text()
    cut = text[: text.rindex('{"kind":"step"') + 25]  # rank 1 killed while writing step 10
    path.write_text(cut)
    records, note = read_jsonl(path)
    assert [r["step"] for r in records if r["kind"] == "step"] == list(range(1, 10))
    assert note and "cut off" in note
    before = _digest(run)
    first = aggregate(run)
    # steps 3-9 read past the warm-up, the cut 10th not (its summary, not its records, says how far it got)
    assert (first.ranks[1].steady_steps, first.ranks[0].steady_steps) == (7, 8)
    assert any(path.name in n for n in first.unreadable)
    # a finished run reads the same every time, and reading changes nothing on disk
    assert aggregate(run) == first and aggregate(run) == first
    assert _digest(run) == before


def test_appends_are_whole_lines_even_with_short_writes(tmp_path, monkeypatch):
    real_write = os.write
    monkeypatch.setattr(files.os, "write", lambda fd, data: real_write(fd, data[:7]))
    path = tmp_path / "r.jsonl"
    append_lines(path, [{"kind": "step", "step": s, "pad": "x" * 40} for s in range(3)])
    append_lines(path, [{"kind": "end"}])
    records, note = read_jsonl(path)
    assert note is None and [r.get("step") for r in records] == [0, 1, 2, None]


def test_atomic_write_leaves_nothing_half_written(tmp_path, monkeypatch):
    target = RunPaths(root=tmp_path).result
    atomic_write_text(target, "old\n")

    def boom(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "replace", boom)
    with pytest.raises(StorageError, match="no space left on the device"):  # one line, not OSError
        atomic_write_text(target, "new\n")
    assert target.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == [target.name]
    assert stat.S_IMODE(target.stat().st_mode) == 0o600


def test_nothing_is_world_writable_with_umask_000(tmp_path):
    old = os.umask(0)
    try:
        run = create_run_dir(None, "r1", root=tmp_path / "deep" / "runs")
        rec = RankRecorder(run, 0, {"host": "h"}, dump_stacks=False)
        rec.add({"kind": "step", "step": 1})
        rec.finish("ok")
    finally:
        os.umask(old)
    for p in [tmp_path / "deep", tmp_path / "deep" / "runs", *tmp_path.joinpath("deep").rglob("*")]:
        assert not p.stat().st_mode & stat.S_IWOTH, p
    assert stat.S_IMODE(run.stat().st_mode) == 0o750


def test_heartbeat_beats_on_a_step_at_most_once_a_second(tmp_path):
    rec = RankRecorder(tmp_path, 3, {"host": "h"})
    heartbeat = RunPaths(root=tmp_path).heartbeat(3)
    beat = json.loads(heartbeat.read_text())
    assert beat["step"] == 0 and beat["pid"] == os.getpid() and beat["stacks"] is False
    rec.add({"kind": "step", "step": 1})  # the first step ends start-up: it beats at once
    assert json.loads(heartbeat.read_text())["step"] == 1
    rec.add({"kind": "step", "step": 2})  # within a second of that beat: no new write
    assert json.loads(heartbeat.read_text())["step"] == 1
    rec._last_beat -= 2
    rec.add({"kind": "step", "step": 3})
    assert json.loads(heartbeat.read_text())["step"] == 3
    assert not list(tmp_path.glob(".*tmp"))


def test_secret_looking_variables_are_masked():
    assert all(is_secret_name(n) for n in ("HF_TOKEN", "wandb_api_key", "AWS_SECRET_ACCESS_KEY",
                                           "DB_PASSWORD", "github_token"))
    assert not any(is_secret_name(n) for n in ("PATH", "OMP_NUM_THREADS", "DLAUNCH_RUN_DIR"))
    assert mask_env({"HF_TOKEN": "hf_abc", "PATH": "/bin"}) == {"HF_TOKEN": MASK, "PATH": "/bin"}
    spec = LaunchSpec(workload="/w/mlp.py", run_id="r", run_dir="/RUN",
                      env={"HF_TOKEN": "hf_abc123", "MY_PASSWORD": "hunter2", "NCCL_DEBUG": "INFO"})
    text = LocalRendered(spec=spec, command=local.render(spec, python="python3", base_env={}, cores=2)).dry_run_text
    assert "hf_abc123" not in text and "hunter2" not in text
    assert f"HF_TOKEN={MASK}" in text and "NCCL_DEBUG=INFO" in text
    assert masked_spec_dict(spec)["env"] == {"HF_TOKEN": MASK, "MY_PASSWORD": MASK, "NCCL_DEBUG": "INFO"}
    # the ranks still get the real value
    assert local.render(spec, python="python3", base_env={}, cores=2).env["HF_TOKEN"] == "hf_abc123"


@pytest.mark.distributed
def test_a_real_run_leaks_no_secret_and_writes_nothing_world_writable(tmp_path):
    secret = "hf_s3cr3t_value_0123456789"
    run = tmp_path / "run"
    done = run_dlaunch("--debug", "run", str(REPO / "workloads" / "mlp.py"), "--gpus", "1", "--steps", "2",
                       "--no-calibrate", "--strategy", "ddp", "--precision", "fp32", "--micro-batch", "4",
                       "--run-dir", str(run), cwd=tmp_path, timeout=180, umask=0,
                       env={"HF_TOKEN": secret, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)})
    assert done.code == 0, done.err[-3000:]
    assert secret not in done.out + done.err
    for p in [run, *run.rglob("*")]:
        assert not p.stat().st_mode & stat.S_IWOTH, p
        if p.is_file():
            assert secret not in p.read_text(errors="replace"), p


def _sources() -> list[Path]:
    return [p for d in ("launcher", "benchmarks", "workloads", "scripts")
            for p in (REPO / d).rglob("*.py")]


def test_no_shell_true_and_no_yaml_load():
    # built from parts so this file does not match itself
    shell, load = "shell" + "=True", re.compile(r"\byaml\.load\(")
    offenders = [f"{p.relative_to(REPO)}:{n}" for p in _sources()
                 for n, line in enumerate(p.read_text().splitlines(), 1)
                 if shell in line or load.search(line)]
    assert offenders == []


# whole-file writes that are safe without atomic_write_*: each with the reason
_ALLOWED_WRITES = {
    "launcher/rundir.py": "the empty .write-test probe",
    "launcher/runtime/checkpoint.py": "inside step-N.partial/, renamed into place as a whole",
    "launcher/report/render.py": "written to a .tmp name, then replace()d",
    "launcher/drivers/sweepdir.py": "the lock file, created O_EXCL; readers take an empty one as stale",
}


def test_launcher_writes_whole_files_only_through_files_py():
    pattern = re.compile(r"\.write_(text|bytes)\(|open\([^)]*['\"]w['\"]")
    offenders = [f"{p.relative_to(REPO)}:{n}: {line.strip()}" for p in (REPO / "launcher").rglob("*.py")
                 if str(p.relative_to(REPO)) not in _ALLOWED_WRITES and p.name != "files.py"
                 for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == [], "write through launcher.files.atomic_write_* (or explain in _ALLOWED_WRITES)"


def test_steps_just_before_a_stop_reach_the_disk_from_one_flusher_thread(tmp_path):
    import threading
    import time

    def flushers() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "dlaunch-flusher"}

    before = flushers()  # another test's recorder that never finished may have left one
    rec = RankRecorder(tmp_path, 0, {"host": "h"})
    paths = RunPaths(root=tmp_path)
    step = 0
    for _burst in range(3):  # three bursts of fast steps, each followed by a pause (a hang)
        for _ in range(5):
            step += 1
            rec.add({"kind": "step", "step": step})
        deadline = time.monotonic() + 5
        while json.loads(paths.heartbeat(0).read_text())["step"] != step and time.monotonic() < deadline:
            time.sleep(0.05)
        assert json.loads(paths.heartbeat(0).read_text())["step"] == step
        steps = [json.loads(line).get("step") for line in paths.records(0).read_text().splitlines()]
        assert steps[-5:] == list(range(step - 4, step + 1))
    assert len(flushers() - before) == 1
    rec.finish("ok")
    deadline = time.monotonic() + 3
    while flushers() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not flushers() - before

"""The hang watcher and the post-mortem, on hand-written heartbeat files and a fake clock
(no torch, no torchrun: the real processes are in tests/integration/test_faults.py)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.backends.monitor import Stall, Watcher, read_heartbeats
from launcher.backends.postmortem import parse_torchrun_exits, write_missing_summaries
from launcher.backends.stacks import StackInfo, parse_stack_dump
from launcher.files import atomic_write_json
from launcher.rundir import RunPaths

HOST = socket.gethostname()

TORCHRUN_REPORT = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
=======================================================
launcher.runtime.entry FAILED
-------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-22_15:41:59
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 14282)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 14282
-------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-22_15:41:58
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 14283)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 14283
=======================================================
"""

STACKS = """\
Thread 0x00007f1 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 327 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f2 (most recent call first):
  File "/work/main/tests/data/fault.py", line 51 in _inject
  File "/work/main/tests/data/fault.py", line 60 in loss_fn
  File "/work/main/launcher/runtime/harness.py", line 176 in forward_backward
  File "/work/main/launcher/runtime/entry.py", line 60 in main
  File "<frozen runpy>", line 88 in _run_code
"""


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def beat(run_dir: Path, rank: int, step: int, *, pid: int | None = None, host: str = "elsewhere") -> None:
    atomic_write_json(RunPaths(root=run_dir).heartbeat(rank),
                      {"step": step, "time": 1.0e9 + step, "pid": pid, "host": host, "stacks": False})


def watcher(run_dir: Path, clock: Clock, **kw) -> Watcher:
    args = {"hang_timeout_s": 10, "startup_timeout_s": 60, **kw}
    return Watcher(run_dir=run_dir, world_size=2, clock=clock, **args)


def test_training_hang_is_reported_after_the_timeout_with_each_ranks_step(tmp_path):
    clock = Clock()
    w = watcher(tmp_path, clock)
    beat(tmp_path, 0, 4), beat(tmp_path, 1, 3)
    assert w.poll() is None
    clock.t += 9
    assert w.poll() is None
    beat(tmp_path, 0, 5)  # rank 0 advanced: the clock restarts when the watcher sees it
    assert w.poll() is None
    clock.t += 9
    assert w.poll() is None
    clock.t += 2
    stall = w.poll()
    assert isinstance(stall, Stall) and stall.kind == "hang"
    assert stall.steps == {0: 5, 1: 3} and stall.ranks == (0, 1)
    assert "no rank advanced for 11 s: rank 0 at step 5, rank 1 at step 3" == stall.message


def test_a_rank_busy_writing_a_snapshot_is_not_hung(tmp_path):
    # RankRecorder.busy beats with a growing busy_beats while the step stands still
    clock = Clock()
    w = watcher(tmp_path, clock)
    beat(tmp_path, 0, 9), beat(tmp_path, 1, 9)
    assert w.poll() is None
    for count in (1, 2, 3):
        clock.t += 9
        for rank in (0, 1):
            atomic_write_json(RunPaths(root=tmp_path).heartbeat(rank),
                              {"step": 9, "time": 1.0e9, "busy": "memory snapshot",
                               "busy_beats": count})
        assert w.poll() is None, count
    clock.t += 11  # the dump is over but nothing moves any more: a hang again
    assert w.poll().kind == "hang"


def test_startup_gets_its_own_allowance(tmp_path):
    clock = Clock()
    w = watcher(tmp_path, clock)
    beat(tmp_path, 0, 0)  # rank 0 is up, rank 1 still importing
    clock.t += 30
    assert w.poll() is None  # 30 s of silence, but within the 60 s startup allowance
    clock.t += 31
    stall = w.poll()
    assert stall is not None and "still starting up" in stall.message
    assert "rank 1 before its first heartbeat" in stall.message


def test_finished_ranks_are_not_hung(tmp_path):
    clock = Clock()
    w = watcher(tmp_path, clock)
    beat(tmp_path, 0, 8), beat(tmp_path, 1, 8)
    for r in (0, 1):
        atomic_write_json(RunPaths(root=tmp_path).summary(r), {"status": "ok"})
    assert w.poll() is None
    clock.t += 5
    assert w.poll() is None
    clock.t += 6  # every rank finished 11 s ago and the job is still there
    assert w.poll().kind == "teardown"


def test_a_plain_script_is_watched_from_its_start_its_batches_a_sign_of_life(tmp_path, monkeypatch):
    import torch

    from launcher.runtime.bootstrap import AutoMeter

    autos = []
    for rank in (0, 1):  # each rank's bootstrap, before its script's first optimizer step
        monkeypatch.setenv("RANK", str(rank))
        autos.append(AutoMeter(str(tmp_path)))
    beats = read_heartbeats(tmp_path)
    assert {r: (b.step, b.pid) for r, b in beats.items()} == {0: (0, None), 1: (0, None)}  # no pid: no summary owed
    clock = Clock()
    w = watcher(tmp_path, clock, script=True)
    for _ in range(24):  # an evaluation loop fetching a batch every 5 s for two minutes: alive
        clock.t += 5
        autos[1]._beat_at = 0.0  # a second has passed for its rate limit
        autos[1].batch(torch.zeros(4, 2), 0.0)
        assert w.poll() is None
    clock.t += 11  # then silence past the start-up allowance: stuck before its first step
    stall = w.poll()
    assert stall.kind == "hang"
    assert "(still starting up after 131 s): rank 0 at step 0, rank 1 at step 0" in stall.message
    assert stall.message.endswith("a script that steps no torch optimizer never advances: --hang-timeout-s 0 "
                                  "leaves it unwatched")



def test_a_scripts_meter_counting_its_beats_again_is_progress(tmp_path, monkeypatch):
    from launcher.runtime.bootstrap import AutoMeter

    monkeypatch.setenv("RANK", "0")
    auto, clock = AutoMeter(str(tmp_path)), Clock()
    w = Watcher(run_dir=tmp_path, world_size=1, clock=clock, hang_timeout_s=10, startup_timeout_s=60, script=True)
    for _ in range(5):  # batches before the first step: the bootstrap's beats, up to 5
        clock.t += 5
        auto._beat_at = 0.0
        auto.batch([1, 2], 0.0)
        assert w.poll() is None
    # the first optimizer step: the meter's recorder beats, its count starting again; then an
    # evaluation loop's batches every 9 s, counted 1, 2, 3 (below the bootstrap's 5): each is progress
    for n in range(4):
        atomic_write_json(RunPaths(root=tmp_path).heartbeat(0), {"step": 1, "time": 1.0e9, "busy_beats": n})
        clock.t += 9
        assert w.poll() is None


def test_zero_timeout_turns_hang_detection_off(tmp_path):
    clock = Clock()
    w = watcher(tmp_path, clock, hang_timeout_s=0)
    beat(tmp_path, 0, 1), beat(tmp_path, 1, 1)
    w.poll()
    clock.t += 10_000
    assert w.poll() is None


def test_a_rank_gone_without_summary_is_noticed_after_a_grace(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid no longer exists
    clock = Clock()
    w = watcher(tmp_path, clock)
    beat(tmp_path, 0, 2, pid=gone.pid, host=HOST)
    beat(tmp_path, 1, 2, pid=None)
    assert w.poll() is None  # torchrun may still end the job itself
    clock.t += 3.5
    stall = w.poll()
    assert stall is not None and stall.kind == "exited" and stall.ranks == (0,)
    assert "rank 0 exited without writing its summary after step 2 while rank(s) 1" in stall.message


def test_a_gone_rank_is_left_to_torchrun_once_torchrun_is_stopping_the_job(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    clock = Clock()
    w = watcher(tmp_path, clock, torchrun_stopping=lambda: True)
    beat(tmp_path, 0, 2, pid=gone.pid, host=HOST)
    w.poll()
    clock.t += 5  # a SIGKILLed rank: torchrun reports its signal; a guess would say less
    assert w.poll() is None


def test_heartbeats_being_replaced_or_garbled_are_skipped(tmp_path):
    beat(tmp_path, 0, 2)
    RunPaths(root=tmp_path).heartbeat(1).write_text('{"step": 3, "ti')
    (tmp_path / "rank-x.heartbeat").write_text("{}")
    assert list(read_heartbeats(tmp_path)) == [0]


def test_torchrun_report_and_stack_dump_parsing():
    exits = parse_torchrun_exits("noise\n" + TORCHRUN_REPORT)
    assert {r: (e.code, e.root) for r, e in exits.items()} == {0: (-15, False), 1: (-9, True)}
    info = parse_stack_dump(STACKS)
    assert info == StackInfo(file="/work/main/tests/data/fault.py", line=51, func="_inject",
                             in_torch=False)
    torch_wait = STACKS.replace('"/work/main/tests/data/fault.py", line 51 in _inject',
                                '"/venv/lib/site-packages/torch/autograd/graph.py", line 829 in run')
    assert parse_stack_dump(torch_wait).in_torch


def _run_dir(tmp_path: Path, steps: int = 2) -> Path:
    for rank in (0, 1):
        lines = [{"kind": "start", "rank": rank, "time": 1.0e9, "host": "h"}]
        lines += [{"kind": "step", "step": s, "time": 1.0e9 + s} for s in range(1, steps + 1)]
        RunPaths(root=tmp_path).records(rank).write_text("".join(json.dumps(x) + "\n" for x in lines))
    return tmp_path


def _summary(run_dir: Path, rank: int) -> dict:
    return json.loads(RunPaths(root=run_dir).summary(rank).read_text())


def test_sigkilled_rank_gets_a_summary_that_sorts_before_the_ranks_it_took_down(tmp_path):
    rd = _run_dir(tmp_path)
    atomic_write_json(RunPaths(root=rd).summary(0), {"status": "failed", "time": 2.0e9,
                                                     "error": "RuntimeError: Connection reset"})
    lines = write_missing_summaries(rd, 2, expected_steps=8, beats={}, torchrun_log=TORCHRUN_REPORT)
    s1 = _summary(rd, 1)
    assert s1["status"] == "killed" and "SIGKILL (9)" in s1["error"] and s1["steps"] == 2
    assert s1["time"] < 2.0e9 and s1["written_by"] == "dlaunch"
    assert _summary(rd, 0)["error"] == "RuntimeError: Connection reset"  # the rank's own word stays
    assert lines == [f"rank 1: killed: {s1['error']}"]


def test_a_sigkilled_rank_leads_when_torchruns_root_cause_only_lost_its_peer(tmp_path):
    # rank 0's gloo pair raised the moment rank 1 vanished and exited 1 before torchrun saw the
    # signal, so torchrun calls rank 0 the root cause: its own error says it lost a peer
    rd = _run_dir(tmp_path)
    lost = ("RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer "
            "[127.0.0.1]:17832. This is typically caused by a remote worker crashing.")
    atomic_write_json(RunPaths(root=rd).summary(0), {"status": "failed", "time": 1.5e9, "error": lost})
    report = (TORCHRUN_REPORT.replace("rank      : 0 (local_rank: 0)", "rank      : X")
              .replace("rank      : 1 (local_rank: 1)", "rank      : 0 (local_rank: 0)")
              .replace("rank      : X", "rank      : 1 (local_rank: 1)")
              .replace("-15 (pid: 14282)  (SIGTERM)", "-9 (pid: 14282)  (SIGKILL)", 1)
              .replace("-9 (pid: 14283)  (SIGKILL)\n  error_file", "1 (pid: 14283)\n  error_file"))
    exits = parse_torchrun_exits(report)
    assert exits[0].root and exits[0].code == 1 and not exits[1].root and exits[1].code == -9
    write_missing_summaries(rd, 2, expected_steps=8, beats={}, torchrun_log=report)
    s1 = _summary(rd, 1)
    assert s1["status"] == "killed" and "SIGKILL (9)" in s1["error"]
    assert s1["time"] < 1.5e9  # its last step: aggregate lists rank 1, the cause, first
    # a root cause that failed of its own is still the cause
    atomic_write_json(RunPaths(root=rd).summary(0), {"status": "failed", "time": 1.5e9,
                                                     "error": "ValueError: injected"})
    RunPaths(root=rd).summary(1).unlink()
    write_missing_summaries(rd, 2, expected_steps=8, beats={}, torchrun_log=report)
    assert _summary(rd, 1)["time"] > 1.5e9


@pytest.mark.parametrize("code, status, error", [
    # aborted in teardown
    ("-6 (pid: 14282)  (SIGABRT)", "killed", "by signal SIGABRT (6)"),
    # 128 + SIGTERM: a handler turned the signal into an exit
    ("143 (pid: 14282)", "failed", "exit code 143 without a summary"),
])
def test_a_rank_dying_while_torchrun_stops_it_is_listed_after_the_root_cause(tmp_path, code, status, error):
    # rank 1 raised (torchrun's first observed failure); rank 0, sent SIGTERM, died of it: its
    # last step predates rank 1's error, but it is not the cause
    rd = _run_dir(tmp_path)
    atomic_write_json(RunPaths(root=rd).summary(1), {"status": "failed", "time": 1.5e9,
                                                     "error": "ValueError: injected"})
    report = (TORCHRUN_REPORT.replace("-15 (pid: 14282)  (SIGTERM)", code)
              .replace("-9 (pid: 14283)  (SIGKILL)", "1 (pid: 14283)"))
    write_missing_summaries(rd, 2, expected_steps=8, beats={}, torchrun_log=report)
    s0 = _summary(rd, 0)
    assert (s0["status"], s0["error"]) == (status, error)
    assert s0["time"] > 1.5e9  # aggregate lists rank 1, the cause, first
    # the root cause itself keeps its last sign of life, whatever its code
    (tmp_path / "alone").mkdir()
    rd2 = _run_dir(tmp_path / "alone")
    write_missing_summaries(rd2, 2, expected_steps=8, beats={}, torchrun_log=TORCHRUN_REPORT.replace(
        "-9 (pid: 14283)  (SIGKILL)", code.replace("14282", "14283")))
    assert _summary(rd2, 1)["time"] < 1.5e9


def test_a_rank_that_said_ok_then_failed_as_it_exited_is_the_cause_and_its_stopped_peer_follows(tmp_path):
    # rank 1 wrote its ok summary, then exited 3 (an atexit handler): torchrun's root cause;
    # rank 0, also ok, was sent SIGTERM in its teardown
    rd = _run_dir(tmp_path)
    for rank, when in ((0, 1.4e9), (1, 1.5e9)):
        atomic_write_json(RunPaths(root=rd).summary(rank), {"status": "ok", "time": when, "steps": 2})
    report = TORCHRUN_REPORT.replace("-9 (pid: 14283)  (SIGKILL)", "3 (pid: 14283)")
    lines = write_missing_summaries(rd, 2, expected_steps=2, beats={}, torchrun_log=report)
    s0, s1 = _summary(rd, 0), _summary(rd, 1)
    assert (s1["status"], s1["time"]) == ("failed", 1.5e9)
    assert s1["error"] == "exit code 3 as it exited, after its summary said ok"
    assert s0["status"] == "stopped" and s0["error"].endswith("as it exited, after another rank failed")
    assert s0["time"] > s1["time"]  # aggregate lists rank 1, the cause, first, though rank 0 said ok earlier
    assert lines == [f"rank 0: stopped: {s0['error']}", f"rank 1: failed: {s1['error']}"]
    # a rank that said ok and was killed while dlaunch stopped the job for a hang is not its cause
    (tmp_path / "hang").mkdir()
    rd2 = _run_dir(tmp_path / "hang")
    atomic_write_json(RunPaths(root=rd2).summary(0), {"status": "ok", "time": 1.4e9, "steps": 2})
    root0 = (TORCHRUN_REPORT.replace("rank      : 1 (local_rank: 1)", "rank      : X")
             .replace("rank      : 0 (local_rank: 0)", "rank      : 1 (local_rank: 1)")
             .replace("rank      : X", "rank      : 0 (local_rank: 0)"))
    stall = Stall(kind="hang", message="rank 1 stopped advancing", steps={0: 2, 1: 1}, ranks=(1,))
    write_missing_summaries(rd2, 2, expected_steps=2, beats={}, stall=stall, torchrun_log=root0)
    assert _summary(rd2, 0)["status"] == "stopped" and _summary(rd2, 1)["status"] == "hung"
    # one that said ok earlier and then exited 1 is not the cause either where another rank is torchrun's root
    (tmp_path / "code").mkdir()
    rd3 = _run_dir(tmp_path / "code")
    for rank, when in ((0, 1.4e9), (1, 1.5e9)):
        atomic_write_json(RunPaths(root=rd3).summary(rank), {"status": "ok", "time": when, "steps": 2})
    write_missing_summaries(rd3, 2, expected_steps=2, beats={}, torchrun_log=report.replace(
        "-15 (pid: 14282)  (SIGTERM)", "1 (pid: 14282)"))
    s0 = _summary(rd3, 0)
    assert (s0["status"], s0["error"]) == ("failed", "exit code 1 as it exited, after another rank failed")
    assert s0["time"] > _summary(rd3, 1)["time"] == 1.5e9


def test_a_rank_dying_while_dlaunch_stops_the_job_for_an_early_exit_is_listed_after_it(tmp_path):
    # rank 1 returned 0 before its last step (dlaunch's watcher saw it leave and stopped the job);
    # rank 0, sent SIGTERM, aborted in teardown and is torchrun's only failure, its "root cause"
    rd = _run_dir(tmp_path)
    report = TORCHRUN_REPORT.replace("-9 (pid: 14283)  (SIGKILL)", "-6 (pid: 14283)  (SIGABRT)").replace(
        "rank      : 1 (local_rank: 1)", "rank      : 0 (local_rank: 0)")
    stall = Stall(kind="exited", message="rank 1 exited before finishing", steps={0: 2, 1: 2}, ranks=(1,))
    write_missing_summaries(rd, 2, expected_steps=8, beats={}, stall=stall, torchrun_log=report)
    s0, s1 = _summary(rd, 0), _summary(rd, 1)
    assert s0["status"] == "killed" and "SIGABRT (6)" in s0["error"] and s1["status"] == "exited"
    assert s1["time"] < s0["time"]  # aggregate lists rank 1, the cause, first


def test_rank_missing_from_torchruns_report_exited_with_code_0(tmp_path):
    rd = _run_dir(tmp_path)
    report = TORCHRUN_REPORT.replace("rank      : 1 (local_rank: 1)", "rank      : 0 (local_rank: 0)")
    write_missing_summaries(rd, 2, expected_steps=8, beats={}, torchrun_log=report)
    assert _summary(rd, 1)["status"] == "exited"
    assert "exit code 0 before finishing its 8 steps" in _summary(rd, 1)["error"]
    RunPaths(root=rd).summary(1).unlink()  # a plain script's rank: its own loop, no count to finish
    write_missing_summaries(rd, 2, expected_steps=None, beats={}, torchrun_log=report)
    assert _summary(rd, 1)["error"] == "exit code 0 before the others finished (no summary)"


def test_hang_names_the_rank_in_its_own_code_first(tmp_path):
    rd = _run_dir(tmp_path)
    # rank 0 was stopped by the SIGTERM and wrote "stopped": the launcher says why
    atomic_write_json(RunPaths(root=rd).summary(0), {"status": "stopped", "time": 3.0e9,
                                                     "error": "Stopped: stopped by SIGTERM"})
    stall = Stall(kind="hang", message="no rank advanced for 10 s: rank 0 at step 2, rank 1 at step 2",
                  steps={0: 2, 1: 2}, ranks=(0, 1))
    stacks = {0: StackInfo(file="/x/torch/autograd/graph.py", line=829, func="run", in_torch=True),
              1: StackInfo(file="/w/fault.py", line=51, func="_inject", in_torch=False)}
    write_missing_summaries(rd, 2, expected_steps=8, beats={}, stall=stall, stacks=stacks)
    s0, s1 = _summary(rd, 0), _summary(rd, 1)
    assert s1["status"] == s0["status"] == "hung"
    assert "stuck in _inject (/w/fault.py:51)" in s1["error"] and stall.message in s1["error"]
    assert "waiting in run" in s0["error"] and "most likely for rank(s) 1" in s0["error"]
    assert s0["rank_error"] == "Stopped: stopped by SIGTERM"
    assert s1["time"] < s0["time"]  # aggregate lists the culprit first


_STOPPED_IN = """Traceback (most recent call last):
  File "/w/launcher/runtime/entry.py", line 85, in main
  File "/w/launcher/runtime/loader.py", line 79, in fetch
  File "/v/site-packages/torch/utils/data/dataloader.py", line 725, in __next__
  File "/py/lib/python3.11/selectors.py", line 415, in select
  File "/w/launcher/runtime/entry.py", line 46, in _on_sigterm
Stopped: stopped by SIGTERM while the job was being ended
"""


def test_a_rank_stopped_in_its_dataloader_is_blamed_for_a_peers_collective_timeout(tmp_path):
    rd = _run_dir(tmp_path)
    timeout = "RuntimeError: [gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms for recv"
    paths = RunPaths(root=rd)
    atomic_write_json(paths.summary(0), {"status": "failed", "time": 3.0e9, "error": timeout})
    atomic_write_json(paths.summary(1), {"status": "stopped", "time": 3.0e9 + 1, "steps": 0,
                                         "error": "Stopped: stopped by SIGTERM", "traceback": _STOPPED_IN})
    lines = write_missing_summaries(rd, 2, expected_steps=8, beats={})
    s1 = _summary(rd, 1)
    assert s1["status"] == "hung" and s1["written_by"] == "dlaunch" and s1["time"] < 3.0e9
    assert s1["error"].startswith("stuck waiting for its DataLoader's next batch (/w/launcher/runtime/loader.py:79)")
    assert "rank(s) 0 timed out waiting for it in a collective" in s1["error"]
    assert lines == [f"rank 1: hung: {s1['error']}"]
    assert _summary(rd, 0)["error"] == timeout  # the waiting rank keeps its own error


def test_a_rank_stopped_inside_torch_is_not_blamed_for_a_timeout(tmp_path):
    rd = _run_dir(tmp_path)
    paths = RunPaths(root=rd)
    in_torch = _STOPPED_IN.replace("utils/data/dataloader.py", "autograd/graph.py").replace(
        '  File "/py/lib/python3.11/selectors.py", line 415, in select\n', "")
    atomic_write_json(paths.summary(0), {"status": "failed", "time": 3.0e9,
                                         "error": "RuntimeError: Timed out waiting 20000ms for send"})
    atomic_write_json(paths.summary(1), {"status": "stopped", "time": 3.0e9 + 1, "traceback": in_torch})
    assert write_missing_summaries(rd, 2, expected_steps=8, beats={}) == []
    assert _summary(rd, 1)["status"] == "stopped"


def test_an_unreadable_summary_is_never_overwritten(tmp_path):
    rd = _run_dir(tmp_path)
    summary = RunPaths(root=rd).summary(1)
    summary.write_text("{not json")
    write_missing_summaries(rd, 2, expected_steps=8, beats={}, torchrun_log=TORCHRUN_REPORT)
    assert summary.read_text() == "{not json"


def test_only_a_scripts_rank_that_left_with_code_0_before_its_peer_lost_it_is_blamed(tmp_path):
    closed = "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:8083"
    report = TORCHRUN_REPORT.replace("rank      : 1 (local_rank: 1)", "rank      : 0 (local_rank: 0)")

    def blamed(*, expected_steps: int | None, ok_time: float | None, log: str = report) -> dict:
        (rd := tmp_path / str(len(list(tmp_path.iterdir())))).mkdir()
        _run_dir(rd)
        paths = RunPaths(root=rd)
        atomic_write_json(paths.summary(0), {"status": "failed", "time": 3.0e9, "error": closed})
        atomic_write_json(paths.summary(1), {"status": "ok", "steps": 3,
                                             **({} if ok_time is None else {"time": ok_time})})
        write_missing_summaries(rd, 2, expected_steps=expected_steps, beats={}, torchrun_log=log)
        return _summary(rd, 1)

    left = blamed(expected_steps=None, ok_time=3.0e9 - 1)
    assert left["status"] == "exited" and left["time"] == 3.0e9 - 1 and left["written_by"] == "dlaunch"
    assert left["error"] == "exit code 0 while rank(s) 0 went on and lost it in a collective"
    assert blamed(expected_steps=8, ok_time=3.0e9 - 1)["status"] == "ok"  # a workload's harness: all ranks alike
    assert blamed(expected_steps=None, ok_time=3.0e9 + 1)["status"] == "ok"  # ended after the loss
    assert blamed(expected_steps=None, ok_time=None)["status"] == "ok"  # no time to order it by
    # not code 0: no leaver, but killed (torchrun's root cause) after its summary said ok
    assert blamed(expected_steps=None, ok_time=3.0e9 - 1, log=TORCHRUN_REPORT)["status"] == "killed"

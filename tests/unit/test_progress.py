"""The live progress line and the drift warning, from synthetic heartbeats (launcher.backends.progress)."""

from __future__ import annotations

import io

from launcher.backends import stacks
from launcher.backends.monitor import Beat
from launcher.backends.progress import DRIFT_SUSTAIN_S, LiveLine, Progress, ProgressSpec, clock
from launcher.backends.stacks import StackInfo


def beats(step: int, t: float, ranks: int = 2, slow: dict[int, float] | None = None) -> dict[int, Beat]:
    """Every rank at `step`, beating at `t` (rank r's clock offset by 1000 r: clocks differ)."""
    return {r: Beat(rank=r, step=step, time=1000.0 * r + t * (slow or {}).get(r, 1.0)) for r in range(ranks)}


def spec(**kw: object) -> ProgressSpec:
    base = dict(total_steps=200, warmup_steps=3, samples_per_step=16, units_per_sample=128,
                unit="tokens", predicted_step_s=0.2)
    return ProgressSpec(**{**base, **kw})  # type: ignore[arg-type]


def test_before_warm_up_ends_there_is_no_rate_and_no_eta():
    p = Progress(spec=spec(), start_s=0.0)
    p.observe(beats(2, 5.0))
    assert p.line(5.0) == "step 2/200 (1%)  elapsed 0:05  warming up"


def test_rate_and_eta_come_from_each_rank_own_clock_after_warm_up():
    p = Progress(spec=spec(), start_s=0.0)
    p.observe(beats(3, 10.0))  # warm-up (compile, first steps) took 10 s: not counted
    p.observe(beats(53, 20.0))  # 50 steps in 10 s: 0.2 s/step, 16 x 128 / 0.2 tokens/s
    line = p.line(20.0)
    assert "step 53/200 (26%)" in line and "10,240 tokens/s" in line
    assert "0.2 s/step (plan 0.2, x1.00)" in line
    assert f"ETA {clock(147 * 0.2)}" in line and "elapsed 0:20" in line


def test_the_slowest_rank_sets_the_pace():
    p = Progress(spec=spec(), start_s=0.0)
    p.observe(beats(3, 10.0, slow={1: 1.5}))
    p.observe(beats(53, 20.0, slow={1: 1.5}))
    assert p.step_time_s() == (0.3, 15.0)


def test_eta_counts_time_since_the_last_beat_as_spent():
    p = Progress(spec=spec(total_steps=60, predicted_step_s=None), start_s=0.0)
    p.observe(beats(10, 0.0, ranks=1))
    p.observe(beats(50, 40.0, ranks=1))  # 1 s/step, 10 left
    assert p.line(40.0).endswith("ETA 0:10") and "plan" not in p.line(40.0)
    assert p.line(40.5, wall_s=40.5).endswith("ETA 0:10")  # 9.5 s rounds to 10
    assert p.line(41.0, wall_s=40.9).endswith("ETA 0:09")


def test_drift_warns_once_when_a_whole_window_is_outside_the_band():
    p = Progress(spec=spec(predicted_step_s=0.1), start_s=0.0)
    t, step = 0.0, 3
    while t < 60:  # on plan for a minute: no warning
        p.observe(beats(step, t))
        assert p.drift() is None
        t, step = t + 1.0, step + 10
    slowed_at = t
    while t < slowed_at + DRIFT_SUSTAIN_S + 2:  # 0.2 s a step from here on
        p.observe(beats(step, t))
        warning = p.drift()
        if warning is not None:
            break
        t, step = t + 1.0, step + 5
    assert warning is not None, "no warning"
    # the window's mean leaves the band only once enough of it is slow, never at the first beat
    assert slowed_at + 3 <= t
    assert "2.00x the plan's 0.1 s" in warning and "slower" in warning
    p.observe(beats(step + 5, t + 1))
    assert p.drift() is None  # once


def test_no_drift_inside_the_band_or_without_a_plan():
    for predicted in (0.19, None):
        p = Progress(spec=spec(predicted_step_s=predicted), start_s=0.0)
        p.observe(beats(3, 0.0))
        p.observe(beats(503, 100.0))
        assert p.drift() is None


def test_a_terminal_keeps_the_line_below_rank_output():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Tty()

    def write(console, text):  # noqa: ANN001, ANN202
        console.write(text)
        return True

    live = LiveLine(Progress(spec=spec(), start_s=0.0), out, beats=lambda: {}, write=write)
    live._drawn = "dlaunch: step 1/200"
    assert live.above("[rank 0] hello\n")
    assert out.getvalue() == "\r\x1b[2K[rank 0] hello\ndlaunch: step 1/200"
    live.stop()
    assert out.getvalue().endswith("\r\x1b[2K")


def _stacks(own: set[int]) -> dict[int, StackInfo]:
    return {r: StackInfo(file="w.py" if r in own else "torch/autograd/graph.py", line=7,
                         func="loss_fn" if r in own else "backward", in_torch=r not in own) for r in (0, 1, 2)}


def test_the_straggler_is_the_rank_found_in_its_own_code(monkeypatch):
    samples = iter([{1}, {1, 2}, {1}, {1}, {0, 1}, {1}, {1}, {1}, {1}, {1}])
    monkeypatch.setattr(stacks, "dump_stacks", lambda *a, **k: _stacks(next(samples)))
    said = stacks.name_straggler("unused", {}, samples=10, gap_s=0)
    assert said is not None and said.startswith("rank 1 was in its own code in 10 of 10 stack samples (in loss_fn (")


def test_ranks_slowed_alike_name_no_one(monkeypatch):
    monkeypatch.setattr(stacks, "dump_stacks", lambda *a, **k: _stacks({0, 1, 2}))
    said = stacks.name_straggler("unused", {}, samples=4, gap_s=0)
    assert said is not None and said.startswith("no rank stood out") and "rank 0 100%" in said
    monkeypatch.setattr(stacks, "dump_stacks", lambda *a, **k: {0: _stacks(set())[0]})
    assert stacks.name_straggler("unused", {}, samples=2, gap_s=0) is None  # one rank: nothing to compare


def test_a_slurm_jobs_progress_counts_a_scripts_steps_against_nothing(tmp_path):
    from launcher.backends.slurm.progress import Progress as SlurmProgress

    from tests.synthetic import write_run

    write_run(tmp_path / "r", world_size=2, steps=20, warmup=2, result=None)
    assert SlurmProgress(tmp_path / "r", 2, 20).line().startswith("step 20/20 (per rank: 20 20)")
    assert SlurmProgress(tmp_path / "r", 2, None).line().startswith("step 20 (per rank: 20 20)")  # its own loop

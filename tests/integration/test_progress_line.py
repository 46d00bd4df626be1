"""`dlaunch run`'s live progress line, in a pipe and in a pseudo-terminal, and its ETA against
the time the run really took (the rank's own step records). The four runs go at once (one module
fixture, mostly asleep in their steps) to keep the suite short; each test reads its own run."""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import pytest

from tests.helpers import DATA, REPO, dlaunch_env, rank_records, seeded_cache

pytestmark = [pytest.mark.distributed, pytest.mark.alone]

STEADY = str(DATA / "steady.py")
FIXED = ["--no-calibrate", "--strategy", "ddp", "--precision", "fp32", "--micro-batch", "4"]
LINE = re.compile(r"dlaunch: step (\d+)/(\d+) \(\d+%\)  ([\d,]+) samples/s  .*ETA (\d+):(\d\d)")


PIPE_ARGS = ["--gpus", "1", "--steps", "120", *FIXED]
TTY_ARGS = ["--gpus", "1", "--steps", "30", *FIXED]
SLEEP = ["--", "--step-sleep-s", "0.1"]
# rank 1 slowed to 0.3 s steps from its 15th on
DRIFT_ARGS = ["--gpus", "2", "--steps", "60", *FIXED]
DRIFT_SLEEP = ["--", "--step-sleep-s", "0.1", "--slow-rank", "1", "--slow-from", "15", "--slow-sleep-s", "0.3"]


def _in_a_pipe(tmp: Path, env: dict[str, str]) -> tuple[Path, Path, list[tuple[float, str]]]:
    """The run's dir, its stdout file and its stderr lines, each with the wall clock when read."""
    run_dir = tmp / "run"
    out = tmp / "stdout"
    with open(out, "w") as stdout:
        proc = subprocess.Popen([sys.executable, "-m", "launcher.cli.main", "run", STEADY, *PIPE_ARGS,
                                 "--run-dir", str(run_dir), *SLEEP], cwd=REPO,
                                env={**env, "DLAUNCH_PROGRESS_INTERVAL_S": "1"}, stdout=stdout,
                                stderr=subprocess.PIPE, text=True)
        seen: list[tuple[float, str]] = []  # (wall clock when read, line)
        assert proc.stderr is not None
        for line in proc.stderr:
            seen.append((time.time(), line))
        assert proc.wait(timeout=300) == 0, "".join(x for _, x in seen)
    return run_dir, out, seen


def _on_a_terminal(tmp: Path, env: dict[str, str], *extra: str) -> str:
    """What the run wrote to its pseudo-terminal."""
    primary, secondary = pty.openpty()
    argv = [sys.executable, "-m", "launcher.cli.main", "run", STEADY, *TTY_ARGS,
            "--run-dir", str(tmp / "run"), *extra, *SLEEP]
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=secondary, stderr=secondary, stdin=subprocess.DEVNULL)
    os.close(secondary)
    chunks = []
    while True:
        try:
            data = os.read(primary, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(primary)
    assert proc.wait(timeout=300) == 0, b"".join(chunks).decode(errors="replace")
    return b"".join(chunks).decode(errors="replace")


def _drifting(tmp: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    # a 6 s window, not the default 20 s: the warning after ~20 slow steps, 25 more of margin
    return subprocess.run(
        [sys.executable, "-m", "launcher.cli.main", "run", STEADY, *DRIFT_ARGS, "--run-dir", str(tmp / "run"),
         "--json", *DRIFT_SLEEP],
        cwd=REPO, env={**env, "DLAUNCH_DRIFT_SUSTAIN_S": "6"}, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Future]:
    """Each run's future, all done (a run's failure is its own test's)."""
    root = tmp_path_factory.mktemp("progress")
    cache = str(seeded_cache(root / "cache"))  # one cache: the runs share their plans
    envs = {}
    for name in ("warm", "pipe", "tty", "quiet", "drift"):
        (root / name).mkdir()
        envs[name] = {**dlaunch_env(root / name), "DLAUNCH_CACHE_DIR": cache}

    def warm(args: list[str], sleep: list[str]) -> None:
        done = subprocess.run([sys.executable, "-m", "launcher.cli.main", "run", STEADY, *args, "--dry-run", *sleep],
                              cwd=REPO, env=envs["warm"], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr

    with ThreadPoolExecutor(4) as pool:
        # both plans measured before the runs: no run measures while another one's steps are timed
        for f in [pool.submit(warm, PIPE_ARGS, SLEEP), pool.submit(warm, DRIFT_ARGS, DRIFT_SLEEP)]:
            f.result()
        futures = {"pipe": pool.submit(_in_a_pipe, root / "pipe", envs["pipe"]),
                   "tty": pool.submit(_on_a_terminal, root / "tty", envs["tty"]),
                   "quiet": pool.submit(_on_a_terminal, root / "quiet", envs["quiet"], "--quiet"),
                   "drift": pool.submit(_drifting, root / "drift", envs["drift"])}
        wait(futures.values())
        return futures


def test_in_a_pipe_a_line_per_interval_and_the_eta_holds(runs):
    run_dir, out, seen = runs["pipe"].result()
    # the lines go to stderr: stdout holds what it did before (rank lines, the summary)
    assert "dlaunch: step " not in out.read_text() and "result: " in out.read_text()
    lines = [(t, m) for t, x in seen if (m := LINE.search(x))]
    assert len(lines) >= 5, "".join(x for _, x in seen)
    # no terminal: whole lines, no cursor movement
    assert not any("\r" in x or "\x1b" in x for _, x in seen)
    # the ETA of the first line past step 30 against when step 120 really ended
    t_line, m = next((t, m) for t, m in lines if int(m.group(1)) >= 30)
    eta_s = 60 * int(m.group(4)) + int(m.group(5))
    ends = {r["step"]: r["end_time"] for r in rank_records(run_dir) if r["kind"] == "step"}
    real_s = ends[120] - t_line
    assert real_s > 5, (real_s, m.group(0))
    assert abs(eta_s - real_s) <= 0.15 * real_s + 0.5, (eta_s, real_s, m.group(0))  # 0.5: m:ss rounding


def test_on_a_terminal_one_line_is_redrawn_and_quiet_turns_it_off(runs):
    text = runs["tty"].result()
    assert "\r\x1b[2Kdlaunch: step " in text and "ETA " in text, text
    assert "run steady-" in text  # the summary follows on a clean line
    quiet = runs["quiet"].result()
    assert "dlaunch: step " not in quiet and "run steady-" in quiet


def test_a_rank_slowed_after_warm_up_raises_the_drift_warning(runs):
    done = runs["drift"].result()
    assert done.returncode == 0, done.stderr
    warned = [x for x in done.stderr.splitlines() if "warning: steps take" in x]
    assert len(warned) == 1, done.stderr
    ratio = float(re.search(r"now, ([\d.]+)x the plan's", warned[0]).group(1))
    assert 2.0 <= ratio <= 3.5, warned[0]  # 0.3 s against a plan of the 0.1 s steps timed
    # stack samples name the rank the others wait for
    named = [x for x in done.stderr.splitlines() if "most likely the straggler" in x]
    assert len(named) == 1 and "rank 1 was in its own code in " in named[0], done.stderr[-3000:]
    assert "steady.py" in named[0], named[0]
    result = json.loads(done.stdout)
    assert any("left the plan's" in w and "rank 1 was in its own code" in w for w in result["warnings"]), \
        result["warnings"]

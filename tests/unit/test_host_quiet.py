"""A probe taken while other processes use the cores it wants is not cached (plan.host_quiet).

Real processes: a CPU-bound Python loop beside a probe that wants every core.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.plan.cpu_probe import measure as probe_cpu
from launcher.plan.host_quiet import IGNORE_LOAD_ENV, Quiet, watch
from launcher.plan.resolve import cached_cpu_rates


def test_busy_means_others_took_cores_the_probe_wanted():
    def quiet(others: float, wanted: float) -> Quiet:
        return Quiet(wall_s=1.0, own_cores=wanted, others_cores=others, usable_cores=2,
                     wanted_cores=wanted)

    assert not quiet(0.1, 2).busy  # daemons and the terminal
    assert quiet(1.0, 2).busy  # a CPU-bound process beside a probe of every core
    assert not quiet(1.0, 1).busy  # one core left free for it
    assert quiet(1.5, 1).busy
    # a host oversubscribed in the minute before: busy even if others paused during the probe
    loaded = Quiet(wall_s=1.0, own_cores=1, others_cores=0.0, usable_cores=2, wanted_cores=1, load_before=3.3)
    assert loaded.busy and "load average 3.3" in loaded.describe()
    assert not Quiet(wall_s=1.0, own_cores=1, others_cores=0.0, usable_cores=2, wanted_cores=1,
                     load_before=2.1).busy


def _spin(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_a_probe_beside_a_cpu_bound_process_is_used_but_not_cached(tmp_path: Path, monkeypatch, caplog):
    monkeypatch.delenv(IGNORE_LOAD_ENV, raising=False)
    made = []

    def measure():  # the real CPU probe (it wants every core), counted
        made.append(1)
        return probe_cpu()

    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        rates = cached_cpu_rates(tmp_path, measure_fn=measure)
    finally:
        hog.kill()
        hog.wait()
    assert rates is not None and made == [1]
    # the thread scaling is part of the probe (every core wanted): measured, not cached either
    assert set(rates.thread_speedup) == {"gemm", "stream", "op"}
    assert not list(tmp_path.glob("*.json")), "a busy host's probe was cached"
    assert "the host was busy while dlaunch measured its CPU rates" in caplog.text
    # the next plan measures again; with the load ignored (as the test suite does) it is cached
    monkeypatch.setenv(IGNORE_LOAD_ENV, "1")
    cached_cpu_rates(tmp_path, measure_fn=measure)
    assert made == [1, 1] and len(list(tmp_path.glob("*.json"))) == 1


@pytest.mark.parametrize("wanted", [1.0, 2.0])
def test_watch_counts_this_process_as_its_own(wanted: float):
    _, quiet = watch(lambda: _spin(0.5), usable_cores=2, wanted_cores=wanted)
    # 0.5 CPU-seconds of its own, however long a loaded host made the wall clock
    assert quiet.own_cores * quiet.wall_s > 0.45 and quiet.wanted_cores == wanted

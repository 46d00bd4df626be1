"""Was the host quiet while dlaunch measured it? A probe taken beside other work is not cached.

The CPU probes (`cpu_probe`, `gloo_probe`, `step_probe`) time this host; a measurement taken while
other processes used the cores is too slow, and cached it would slow every later plan (a probe
cached during a test suite once made `dlaunch tune` store 0.31 as this machine's correction).
`watch` measures, over the probe, the CPU time every other process used (the system's busy time,
steal included, less this process's and its children's); the host was busy when the others took
cores the probe wanted (the CPU rates probe every core, the step probe a rank's threads, the gloo
probe its ranks):

    others_cores > usable_cores - wanted_cores + BUSY_MARGIN_CORES

or when the 1-minute load average was above the usable cores + BUSY_MARGIN_CORES: work that paused
for the probe's few seconds, or that shares the memory bus and caches, still slows it (a step probe
cached at load 3.3 on 2 cores predicted 0.79 s for a step that took 0.49 s on the idle host).

A busy measurement still serves the plan being made, uncached, and a line says so.
DLAUNCH_PROBE_IGNORE_LOAD=1 caches regardless: a test suite running two workers on two cores is
never quiet, and re-measuring at every plan would only slow it down.

Reads /proc through psutil; never imports torch, cli, backends, jobs, runtime, results or report.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import psutil

_T = TypeVar("_T")
# noise a quiet machine shows (daemons, the terminal, the kernel's own threads)
BUSY_MARGIN_CORES = 0.25
IGNORE_LOAD_ENV = "DLAUNCH_PROBE_IGNORE_LOAD"


@dataclass(frozen=True, kw_only=True)
class Quiet:
    """What the host did while a probe ran."""

    wall_s: float
    own_cores: float  # the probe's mean CPU use, in cores
    others_cores: float  # every other process's, in cores
    usable_cores: int
    wanted_cores: float  # what the probe runs on when it has the host to itself
    load_before: float = 0.0  # the 1-minute load average when the probe began

    @property
    def busy(self) -> bool:
        """Others took cores the probe wanted, or the host was oversubscribed just before."""
        return (self.others_cores > self.usable_cores - self.wanted_cores + BUSY_MARGIN_CORES
                or self.load_before > self.usable_cores + BUSY_MARGIN_CORES)

    def describe(self) -> str:
        """'other processes used 1.1 of 2 cores; the probe wanted 2 and got 0.9; load 3.3'."""
        return (f"other processes used {self.others_cores:.1f} of {self.usable_cores} cores; the probe wanted "
                f"{self.wanted_cores:g} and got {self.own_cores:.1f}; load average {self.load_before:.1f} before it")


def _busy_s() -> float:
    t = psutil.cpu_times()
    return float(sum(getattr(t, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal")))


def _own_s() -> float:
    t = psutil.Process().cpu_times()
    return float(t.user + t.system + t.children_user + t.children_system)


def watch(measure: Callable[[], _T], usable_cores: int, wanted_cores: float) -> tuple[_T, Quiet]:
    """`measure()`, and what the rest of the host did meanwhile."""
    load = os.getloadavg()[0]
    busy0, own0, t0 = _busy_s(), _own_s(), time.monotonic()
    value = measure()
    wall = max(time.monotonic() - t0, 1e-6)
    own = max(0.0, _own_s() - own0)
    others = max(0.0, _busy_s() - busy0 - own)
    return value, Quiet(wall_s=wall, own_cores=own / wall, others_cores=others / wall, usable_cores=usable_cores,
                        wanted_cores=min(wanted_cores, usable_cores), load_before=load)


def cacheable(quiet: Quiet) -> bool:
    """Whether a probe taken under `quiet` may be cached."""
    return not quiet.busy or os.environ.get(IGNORE_LOAD_ENV) == "1"


__all__ = ["Quiet", "watch", "cacheable", "BUSY_MARGIN_CORES", "IGNORE_LOAD_ENV"]

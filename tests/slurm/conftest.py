"""A real local SLURM cluster for the `slurm` tests.

The session-scoped fixture ``slurm_cluster`` runs ``scripts/slurm-cluster.sh up`` once per test
session (installs slurm/munge/mariadb with apt if missing; needs root) and ``down`` at the end.

* If the cluster cannot be started (not root, no apt-get, install failed, a daemon did not come
  up) every test that uses the fixture is SKIPPED; the reason names the failing step
  (see ``pytest -rs``).
* ``DLAUNCH_REQUIRE_SLURM=1`` (set in CI) turns that skip into a failure.
* ``DLAUNCH_SLURM_KEEP=1`` leaves the cluster running after the session (the next session's
  ``up`` then returns in well under a second); stop it with ``scripts/slurm-cluster.sh down``.
* ``DLAUNCH_SLURM_BASE`` moves the cluster's state/logs (default ``/tmp/dlaunch-slurm``).

The fixture is not shared between pytest-xdist workers: run the slurm tests in one process
(``-p no:xdist`` or ``-n 0``), or start the cluster before pytest and set DLAUNCH_SLURM_KEEP=1.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test here is `alone` (pyproject's markers): they share the one local cluster."""
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.alone)

SCRIPT = REPO_ROOT / "scripts" / "slurm-cluster.sh"
UP_TIMEOUT_S = 900  # from scratch (apt install) this takes ~25 s; a slow mirror may take minutes
DOWN_TIMEOUT_S = 300


@dataclasses.dataclass(frozen=True)
class SlurmCluster:
    """Handle to the running test cluster, as yielded by the ``slurm_cluster`` fixture."""

    base: Path  # DLAUNCH_SLURM_BASE: run/ (PID files), log/ (daemon logs), state/
    script: Path  # scripts/slurm-cluster.sh
    partition: str = "debug"  # the only partition, and the default one
    nodes: tuple[str, ...] = ("n1", "n2")  # NodeName of each slurmd; both resolve to 127.0.0.1
    cpus_per_node: int = 2
    mem_per_node_mb: int = 4000
    python: str = sys.executable  # the venv python; use it for job commands
    repo_root: Path = REPO_ROOT
    up_output: str = ""  # stdout of `up` (per-phase timings)

    @property
    def head_node(self) -> str:
        """First node of a job that gets all nodes (SLURM_JOB_NODELIST=n[1-2] -> n1)."""
        return self.nodes[0]

    @property
    def log_dir(self) -> Path:
        return self.base / "log"

    def job_env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """os.environ with the repo root first on PYTHONPATH (sbatch/srun export the environment,
        so jobs can import `launcher` and the pickled functions' modules)."""
        env = dict(os.environ)
        pp = [str(self.repo_root)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(pp))
        env.update(extra or {})
        return env

    def run(self, argv: Iterable[str], *, check: bool = True, timeout: float = 60,
            env: Mapping[str, str] | None = None, cwd: str | Path | None = None) -> subprocess.CompletedProcess[str]:
        """Run a command (argv list, no shell) and return the CompletedProcess (text)."""
        argv = [str(a) for a in argv]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              env=dict(env) if env is not None else None, cwd=cwd)
        if check and proc.returncode != 0:
            raise AssertionError(
                f"{argv} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
        return proc

    def squeue(self, *args: str) -> str:
        return self.run(["squeue", *args]).stdout

    def sinfo(self, *args: str) -> str:
        return self.run(["sinfo", *args]).stdout

    def sacct(self, *args: str) -> str:
        return self.run(["sacct", *args]).stdout

    def scontrol(self, *args: str) -> str:
        return self.run(["scontrol", *args]).stdout

    def sacct_state(self, job_id: str | int) -> str:
        """State of the job's allocation in sacct ('' while sacct does not know it yet),
        e.g. 'COMPLETED', 'FAILED', 'CANCELLED by 0'."""
        out = self.sacct("-X", "-n", "-P", "-j", str(job_id), "-o", "JobID,State")
        for line in out.splitlines():
            jid, _, state = line.partition("|")
            if jid == str(job_id):
                return state.strip()
        return ""

    def wait_sacct_state(self, job_id: str | int, *states: str, timeout: float = 30) -> str:
        """Poll sacct until the job's state starts with one of `states` (sacct trails squeue
        slightly); returns the state, raises AssertionError on timeout."""
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.sacct_state(job_id)
            if state.startswith(states):
                return state
            time.sleep(0.2)
        raise AssertionError(f"job {job_id}: sacct state {state!r} after {timeout} s, wanted {states}")

    def wait_idle(self, timeout: float = 30) -> None:
        """Wait until every node is idle (e.g. after a previous test's job is still completing)."""
        deadline = time.monotonic() + timeout
        out = ""
        while time.monotonic() < deadline:
            out = self.sinfo("-h", "-N", "-o", "%N %T")
            states = dict(line.split() for line in out.splitlines() if line.strip())
            if all(states.get(n) == "idle" for n in self.nodes):
                return
            time.sleep(0.2)
        raise AssertionError(f"nodes not idle after {timeout} s:\n{out}")


def _failure_reason(proc: subprocess.CompletedProcess[str]) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    summary = [ln for ln in lines if ln.startswith("dlaunch-slurm: FAILED")]
    if summary:
        return summary[-1].removeprefix("dlaunch-slurm: ")
    tail = " | ".join((lines or proc.stdout.splitlines() or ["no output"])[-3:])
    return f"exit {proc.returncode}: {tail}"


def _unavailable(reason: str, details: str = "") -> None:
    if os.environ.get("DLAUNCH_REQUIRE_SLURM") == "1":
        pytest.fail(f"DLAUNCH_REQUIRE_SLURM=1 but the SLURM test cluster could not be started: "
                    f"{reason}\n{details}", pytrace=False)
    if details:
        print(details, file=sys.stderr)
    pytest.skip(f"SLURM test cluster unavailable: {reason}")


def _script_env() -> dict[str, str]:
    env = dict(os.environ)
    # the script's own PATH lookups (apt-get, slurm daemons in /usr/sbin) must work even if the
    # test runner's PATH is minimal
    path = env.get("PATH", "")
    for d in ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"):
        if d not in path.split(os.pathsep):
            path = f"{path}{os.pathsep}{d}" if path else d
    env["PATH"] = path
    return env


@pytest.fixture(scope="session")
def slurm_cluster(request: pytest.FixtureRequest) -> Iterator[SlurmCluster]:
    """Start (or reuse) the local 2-node SLURM cluster for this session; see the module doc."""
    base = Path(os.environ.get("DLAUNCH_SLURM_BASE", "/tmp/dlaunch-slurm"))
    if not sys.platform.startswith("linux"):
        _unavailable(f"step 'preflight': needs Linux, this is {sys.platform}")
    if shutil.which("bash") is None:
        _unavailable("step 'preflight': bash not found")
    if os.geteuid() != 0:
        _unavailable(f"step 'preflight': must run as root (euid {os.geteuid()}); "
                     f"it installs packages and writes /etc/slurm, /etc/hosts")

    argv = ["bash", str(SCRIPT), "up"]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=UP_TIMEOUT_S,
                              env=_script_env(), stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        # the script's own cleanup did not run; stop whatever it started
        subprocess.run(["bash", str(SCRIPT), "down"], capture_output=True, text=True,
                       timeout=DOWN_TIMEOUT_S, env=_script_env(), stdin=subprocess.DEVNULL)
        _unavailable(f"`{SCRIPT.name} up` timed out after {UP_TIMEOUT_S} s", str(e.stdout or ""))
    took = time.monotonic() - t0
    if proc.returncode != 0:
        _unavailable(_failure_reason(proc),
                     f"--- {SCRIPT.name} up (exit {proc.returncode}) ---\n{proc.stdout}\n{proc.stderr}")

    tr = request.config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        tr.write_line(f"slurm test cluster up in {took:.1f} s (BASE={base}, partition debug, nodes n1 n2)")

    cluster = SlurmCluster(base=base, script=SCRIPT, up_output=proc.stdout)
    yield cluster

    # a cluster this session found running belongs to whoever started it (another pytest
    # session, a developer): stopping it would pull it out from under them
    if os.environ.get("DLAUNCH_SLURM_KEEP") == "1" or "already up and healthy" in proc.stdout:
        return
    down = subprocess.run(["bash", str(SCRIPT), "down"], capture_output=True, text=True,
                          timeout=DOWN_TIMEOUT_S, env=_script_env(), stdin=subprocess.DEVNULL)
    if down.returncode != 0:
        pytest.fail(f"`{SCRIPT.name} down` failed: {_failure_reason(down)}\n{down.stdout}\n{down.stderr}",
                    pytrace=False)

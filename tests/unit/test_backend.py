"""The Backend interface (launcher.backends.base): a third backend plugs into status / logs /
cancel and `select` with no change to the CLI; local status, logs and cancel read crafted run
dirs; the adapters render exactly what the functions they wrap render (the golden files)."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import IO

import pytest

from launcher.backends import local, localrun
from launcher.backends.base import Cancelled, JobStatus, Registry, State, owner_of, select
from launcher.backends.slurm import runs
from launcher.backends.slurm import submit as slurm_submit
from launcher.backends.slurm.jobs import JobInfo
from launcher.cli import jobs as cli_jobs
from launcher.errors import UsageError
from launcher.jobs.local import LocalBackend, LocalRendered, dry_run_text
from launcher.jobs.slurm import SlurmBackend, SlurmRendered
from launcher.rundir import RunPaths
from launcher.specs import LaunchSpec, SlurmSpec, Strategy

HOST = socket.gethostname()


# --- a third backend, in the test only -------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class JobSetRendered:
    spec: LaunchSpec

    @property
    def dry_run_text(self) -> str:
        return f"kubectl apply -f jobset-{self.spec.run_id}.yaml\n"


@dataclass(frozen=True, kw_only=True)
class JobSetHandle:
    rendered: JobSetRendered

    def follow(self, out: IO[str]) -> None:
        out.write(f"jobset {self.rendered.spec.run_id} submitted\n")


@dataclass
class JobSetBackend:
    """A Kubernetes JobSet stand-in: its runs are `jobset/<name>` references."""

    name: str = "jobset"
    cancelled: list[str] = field(default_factory=list)

    def claims(self, ref: str) -> bool:
        return ref.startswith("jobset/")

    def render(self, spec: LaunchSpec, request: object = None) -> JobSetRendered:
        return JobSetRendered(spec=spec)

    def start(self, rendered: JobSetRendered, *, as_json: bool = False, debug: bool = False,
              note: str | None = None, quiet: bool = False) -> JobSetHandle:
        return JobSetHandle(rendered=rendered)

    def status(self, ref: str) -> JobStatus:
        return JobStatus(state=State.RUNNING, reason="3/4 pods ready", steps={0: 7},
                         text=f"{ref}: RUNNING (3/4 pods ready)", data={"ref": ref, "state": "RUNNING"})

    def logs(self, ref: str, *, out: IO[str], rank: int | None = None, follow: bool = False) -> None:
        out.write(f"[rank {rank or 0}] hello from {ref}\n")

    def cancel(self, ref: str) -> Cancelled:
        self.cancelled.append(ref)
        return Cancelled(before=State.RUNNING, after=State.CANCELLED, message=f"{ref} deleted")


def spec(**kw: object) -> LaunchSpec:
    base: dict[str, object] = dict(workload="/work/workloads/gpt.py", workload_args=("--size", "tiny"),
                                   run_id="gpt-golden", run_dir="/RUN", nproc_per_node=2, steps=30,
                                   micro_batch=8, strategy=Strategy(kind="ddp"))
    return LaunchSpec(**{**base, **kw})  # type: ignore[arg-type]


def test_a_third_backend_plugs_into_the_cli_commands_through_the_registry():
    jobset = JobSetBackend()
    registry: Registry = {"jobset": jobset, **cli_jobs.BACKENDS}
    out = io.StringIO()
    assert cli_jobs.status("jobset/train-1", out=out, registry=registry) == 0
    assert out.getvalue() == "jobset/train-1: RUNNING (3/4 pods ready)\n"
    out = io.StringIO()
    cli_jobs.status("jobset/train-1", as_json=True, out=out, registry=registry)
    assert json.loads(out.getvalue()) == {"ref": "jobset/train-1", "state": "RUNNING"}
    out = io.StringIO()
    cli_jobs.logs("jobset/train-1", rank=2, out=out, registry=registry)
    assert out.getvalue() == "[rank 2] hello from jobset/train-1\n"
    out = io.StringIO()
    cli_jobs.cancel("jobset/train-1", out=out, registry=registry)
    assert out.getvalue() == "jobset/train-1 deleted\n" and jobset.cancelled == ["jobset/train-1"]
    # a new run: render, start, follow through the interface alone
    chosen = select(registry, slurm=False, name="jobset")
    rendered = chosen.render(spec(), SimpleNamespace(slurm=None))  # type: ignore[arg-type]
    assert rendered.dry_run_text == "kubectl apply -f jobset-gpt-golden.yaml\n"
    out = io.StringIO()
    assert chosen.start(rendered).follow(out) is None and out.getvalue() == "jobset gpt-golden submitted\n"


def test_select_picks_by_slurm_and_refuses_an_unknown_name():
    assert isinstance(select(cli_jobs.BACKENDS, slurm=False), LocalBackend)
    assert isinstance(select(cli_jobs.BACKENDS, slurm=True), SlurmBackend)
    assert isinstance(cli_jobs.backend_for_run(slurm=True), SlurmBackend)
    with pytest.raises(UsageError, match="no backend 'k8s'; known: local, slurm"):
        select(cli_jobs.BACKENDS, slurm=False, name="k8s")


def test_a_run_dir_goes_to_slurm_with_slurm_json_and_to_local_without(tmp_path: Path):
    (tmp_path / "slurm.json").write_text("{}")
    assert isinstance(owner_of(cli_jobs.BACKENDS, str(tmp_path)), SlurmBackend)
    assert isinstance(owner_of(cli_jobs.BACKENDS, "12345"), SlurmBackend)  # a bare job id
    (tmp_path / "slurm.json").unlink()
    assert isinstance(owner_of(cli_jobs.BACKENDS, str(tmp_path)), LocalBackend)
    with pytest.raises(UsageError, match="neither a run directory nor a SLURM job id"):
        owner_of(cli_jobs.BACKENDS, "nowhere")
    with pytest.raises(UsageError, match="not a SLURM run"):  # an empty dir is no run of either
        cli_jobs.status(str(tmp_path))


def test_the_adapters_render_what_the_functions_they_wrap_render(tmp_path: Path):
    s = spec(run_dir=str(tmp_path))
    rendered = LocalBackend().render(s)
    assert isinstance(rendered, LocalRendered)
    assert rendered.dry_run_text == dry_run_text(s, local.render(s))
    slurm = SlurmSpec(partition="debug", cpus_per_node=4)
    sr = SlurmBackend().render(s, SimpleNamespace(slurm=slurm))  # type: ignore[arg-type]
    assert isinstance(sr, SlurmRendered)
    assert sr.dry_run_text == slurm_submit.dry_run_text(s, slurm, slurm_submit.render(s, slurm))
    with pytest.raises(TypeError):
        LocalBackend().start(sr)


def test_slurm_states_map_onto_the_neutral_ones():
    assert runs.state_of(JobInfo(job_id="1", state="PENDING")) is State.PENDING
    assert runs.state_of(JobInfo(job_id="1", state="COMPLETING")) is State.RUNNING
    assert runs.state_of(JobInfo(job_id="1", state="TIMEOUT")) is State.FAILED
    assert runs.state_of(JobInfo(job_id="1", state="CANCELLED")) is State.CANCELLED
    assert runs.state_of(JobInfo(job_id="1", state="WEIRD")) is State.UNKNOWN
    assert not State.RUNNING.final and State.GONE.final


# --- local runs, on crafted run dirs ----------------------------------------------------------


def _run_dir(tmp_path: Path, *, pid: int | None = None, host: str = HOST, since: float | None = None,
             beats: dict[int, tuple[int, float]] | None = None, result: dict | None = None,
             ranks: int = 2) -> Path:
    """A run dir as dlaunch leaves it: launch.json, owner.json, heartbeats, maybe result.json."""
    run_dir = tmp_path / "run"
    paths = RunPaths(root=run_dir)
    run_dir.mkdir()
    paths.launch.write_text(json.dumps({"num_nodes": 1, "nproc_per_node": ranks, "steps": 50}))
    owner = {"host": host, "time": time.time() if since is None else since, "run_id": "r"}
    if pid is not None:
        owner["pid"] = pid
    paths.owner.write_text(json.dumps(owner))
    for rank, (step, when) in (beats or {}).items():
        paths.heartbeat(rank).write_text(json.dumps({"step": step, "time": when, "pid": None, "host": host}))
    if result is not None:
        paths.result.write_text(json.dumps(result))
    return run_dir


def _dead_pid() -> int:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


def test_a_local_run_whose_owner_lives_is_running_with_its_rank_steps(tmp_path: Path):
    now = time.time()
    run_dir = _run_dir(tmp_path, pid=os.getpid(), since=now, beats={0: (12, now - 1), 1: (11, now - 2)})
    st = localrun.read_state(run_dir, now=lambda: now)
    assert st.state is State.RUNNING and st.steps == {0: 12, 1: 11} and st.total_steps == 50
    assert st.reason == f"dlaunch pid {os.getpid()}; last heartbeat 1.0 s ago"
    assert localrun.progress_line(st) == "step 11/50 (per rank: 12 11)"
    stale = localrun.read_state(run_dir, now=lambda: now + 120)
    assert stale.state is State.RUNNING and "no heartbeat for 121 s" in stale.reason
    status = LocalBackend().status(str(run_dir))
    assert status.state is State.RUNNING and status.data["steps"] == {"0": 12, "1": 11}
    assert status.text.startswith(f"run {run_dir.resolve()}: RUNNING (dlaunch pid {os.getpid()};")


def test_a_local_run_starting_up_has_no_heartbeat_yet(tmp_path: Path):
    st = localrun.read_state(_run_dir(tmp_path, pid=os.getpid()))
    assert st.state is State.RUNNING and "no rank heartbeat yet" in st.reason
    assert localrun.progress_line(st) == ""


def test_a_local_run_whose_owner_died_without_a_result_is_gone(tmp_path: Path):
    run_dir = _run_dir(tmp_path, pid=_dead_pid(), beats={0: (3, time.time() - 30)})
    st = localrun.read_state(run_dir)
    assert st.state is State.GONE and "is gone and wrote no result.json" in st.reason
    assert st.steps == {0: 3}
    done = localrun.cancel(run_dir)
    assert done.before is State.GONE and "nothing to cancel" in done.message


def test_a_recycled_owner_pid_does_not_make_a_run_running(tmp_path: Path):
    # this process started before the owner file says dlaunch claimed the dir: not the owner
    run_dir = _run_dir(tmp_path, pid=os.getpid(), since=time.time() - 10 ** 6)
    assert localrun.read_state(run_dir).state is State.GONE


@pytest.mark.parametrize(("result", "state", "reason"), [
    ({"status": "ok", "failures": []}, State.COMPLETED, ""),
    ({"status": "failed", "failures": ["rank 1 raised ValueError"]}, State.FAILED, "rank 1 raised ValueError"),
    ({"status": "hung", "failures": []}, State.FAILED, "result.json says hung"),
    ({"status": "interrupted", "exit_code": 143, "failures": []}, State.CANCELLED, "interrupted, exit 143"),
])
def test_a_finished_local_run_is_what_its_result_says(tmp_path: Path, result: dict, state: State, reason: str):
    run_dir = _run_dir(tmp_path, pid=os.getpid(), result=result)  # result.json wins over a live owner
    st = localrun.read_state(run_dir)
    assert (st.state, st.reason) == (state, reason)
    done = LocalBackend().cancel(str(run_dir))
    assert done.before is done.after is state
    assert done.message == f"run {run_dir.resolve()} already ended ({state.value}: {reason}); nothing to cancel"


def test_a_run_of_another_host_cannot_be_told_nor_cancelled_from_here(tmp_path: Path):
    run_dir = _run_dir(tmp_path, pid=1, host="elsewhere")
    st = localrun.read_state(run_dir)
    assert st.state is State.UNKNOWN and "on host elsewhere" in st.reason
    with pytest.raises(Exception, match="cancel it on that host"):
        localrun.cancel(run_dir)


def test_cancel_sends_sigterm_to_the_owner_and_waits_until_it_is_gone(tmp_path: Path):
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        run_dir = _run_dir(tmp_path, pid=owner.pid, since=time.time() + 1)
        done = localrun.cancel(run_dir, wait_s=10)
        assert done.before is State.RUNNING and done.after is State.GONE  # a sleeper writes no result
        assert f"sent SIGTERM to dlaunch (pid {owner.pid})" in done.message
        assert owner.wait(timeout=5) == -15
    finally:
        owner.kill()


def test_local_logs_print_every_rank_or_one(tmp_path: Path):
    run_dir = _run_dir(tmp_path, pid=_dead_pid())
    for rank in (0, 1):
        d = RunPaths(root=run_dir).node_logs(0) / "r_abc" / "attempt_0" / str(rank)
        d.mkdir(parents=True)
        (d / "stdout.log").write_text(f"out {rank}\n")
        (d / "stderr.log").write_text(f"err {rank}\n" if rank else "")
    out = io.StringIO()
    localrun.logs(run_dir, out=out)
    text = out.getvalue()
    assert [ln for ln in text.splitlines() if not ln.startswith("==>")] == ["out 0", "out 1", "err 1"]
    assert text.count("==> ") == 3
    out = io.StringIO()
    LocalBackend().logs(str(run_dir), out=out, rank=1)
    assert out.getvalue() == "out 1\nerr 1\n"
    out = io.StringIO()
    localrun.logs(run_dir, out=out, follow=True, poll_s=0.01)  # not running: one pass, prefixed
    assert out.getvalue() == "[rank 0] out 0\n[rank 1] out 1\n[rank 1] err 1\n"
    with pytest.raises(UsageError, match="--rank 2 is out of range: the run has ranks 0-1"):
        localrun.logs(run_dir, out=io.StringIO(), rank=2)

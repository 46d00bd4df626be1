"""The Backend interface (launcher.backends.base): a third backend plugs into status / logs /
cancel, `select` and the driver with no change to the CLI; local status, logs and cancel read
crafted run dirs; the backends render exactly what the functions they wrap render (the golden
files)."""

from __future__ import annotations

import io
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import IO

import pytest

from launcher.backends import local, localrun
from launcher.backends.base import (
    Ask,
    Cancelled,
    Ended,
    JobStatus,
    Placement,
    Registry,
    State,
    owner_of,
    parse_world_sizes,
    point_shapes,
    select,
)
from launcher.backends.host import LocalBackend, LocalRendered
from launcher.backends.slurm import backend as runs
from launcher.backends.slurm import submit as slurm_submit
from launcher.backends.slurm.backend import SlurmBackend, SlurmRendered
from launcher.backends.slurm.queue import JobInfo
from launcher.cli import runs as cli_jobs
from launcher.drivers.launch import launch
from launcher.errors import UsageError
from launcher.rundir import RunPaths, TunePaths
from launcher.runspec import LaunchSpec
from launcher.specs import SlurmSpec
from launcher.sweepmanifest import read_manifest

from tests.helpers import REPO
from tests.synthetic import write_run

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

    def follow(self, out: IO[str]) -> Ended:
        out.write(f"jobset {self.rendered.spec.run_id} submitted\n")
        return Ended(detached=f"jobset/{self.rendered.spec.run_id}")


@dataclass
class JobSetBackend:
    """A Kubernetes JobSet stand-in: its runs are `jobset/<name>` references."""

    name: str = "jobset"
    cancelled: list[str] = field(default_factory=list)

    def claims(self, ref: str) -> bool:
        return ref.startswith("jobset/")

    def render(self, spec: LaunchSpec, request: object = None) -> JobSetRendered:
        return JobSetRendered(spec=spec)

    def start(self, rendered: JobSetRendered, *, attempt: int = 0, debug: bool = False,
              note: str | None = None, progress: object = None) -> JobSetHandle:
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
                                   run_id="gpt-golden", run_dir="/RUN", gpus=2, steps=30,
                                   micro_batch=8, strategy="ddp")
    return LaunchSpec(**{**base, **kw})  # type: ignore[arg-type]


def test_a_third_backend_plugs_into_the_cli_commands_through_the_registry(tmp_path: Path):
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
    # a new run: render, then start and follow through the driver, on the interface alone
    chosen = select(registry, slurm=False, name="jobset")
    rendered = chosen.render(spec(run_dir=str(tmp_path)), SimpleNamespace(slurm=None))  # type: ignore[arg-type]
    assert rendered.dry_run_text == "kubectl apply -f jobset-gpt-golden.yaml\n"
    out = io.StringIO()
    assert launch(rendered, chosen, out) is None  # a job left running (detached): no result
    assert out.getvalue().startswith("jobset gpt-golden submitted\nsubmitted job jobset/gpt-golden\n")


def test_select_picks_by_slurm_and_refuses_an_unknown_name():
    assert isinstance(select(cli_jobs.BACKENDS, slurm=False), LocalBackend)
    assert isinstance(select(cli_jobs.BACKENDS, slurm=True), SlurmBackend)
    assert isinstance(select(cli_jobs.BACKENDS, slurm=True), SlurmBackend)  # the CLI's registry
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


def test_the_backends_render_what_the_functions_they_wrap_render(tmp_path: Path):
    s = spec(run_dir=str(tmp_path))
    rendered = LocalBackend().render(s)
    assert isinstance(rendered, LocalRendered)
    assert rendered.dry_run_text == LocalRendered(spec=s, command=local.render(s)).dry_run_text
    assert rendered.dry_run_text.startswith(f"# command\n{shlex.join(local.render(s).argv)}\n")
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
    assert not State.RUNNING.final and State.ORPHANED.final


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
    # a plain script runs its own loop: launch.json's steps is no total for it
    launch = RunPaths(root=run_dir).launch
    launch.write_text(json.dumps({**json.loads(launch.read_text()), "is_script": True}))
    script = localrun.read_state(run_dir, now=lambda: now)
    assert script.total_steps is None and localrun.progress_line(script) == "step 11 (per rank: 12 11)"


def test_a_local_run_starting_up_has_no_heartbeat_yet(tmp_path: Path):
    st = localrun.read_state(_run_dir(tmp_path, pid=os.getpid()))
    assert st.state is State.RUNNING and "no rank heartbeat yet" in st.reason
    assert localrun.progress_line(st) == ""


def test_a_local_run_whose_owner_died_without_a_result_is_gone(tmp_path: Path):
    run_dir = _run_dir(tmp_path, pid=_dead_pid(), beats={0: (3, time.time() - 30)})
    st = localrun.read_state(run_dir)
    assert st.state is State.ORPHANED and "is gone and wrote no result.json" in st.reason
    assert st.steps == {0: 3}
    done = localrun.cancel(run_dir)
    assert done.before is State.ORPHANED and "nothing to cancel" in done.message


def test_a_recycled_owner_pid_does_not_make_a_run_running(tmp_path: Path):
    # this process started before the owner file says dlaunch claimed the dir: not the owner
    run_dir = _run_dir(tmp_path, pid=os.getpid(), since=time.time() - 10 ** 6)
    assert localrun.read_state(run_dir).state is State.ORPHANED


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
    how = f"{state.value}: {reason}" if reason else state.value  # COMPLETED says no more
    assert done.message == f"run {run_dir.resolve()} already ended ({how}); nothing to cancel"


def test_following_a_starting_run_prints_its_ranks_once_launch_json_appears(tmp_path: Path):
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    out = io.StringIO()
    try:
        run_dir = _run_dir(tmp_path, pid=owner.pid, since=time.time() + 1)
        paths = RunPaths(root=run_dir)
        paths.launch.unlink()  # the run dir is claimed before launch.json is written
        follower = threading.Thread(target=localrun.logs, args=(run_dir,),
                                    kwargs={"out": out, "follow": True, "poll_s": 0.02})
        follower.start()
        time.sleep(0.3)
        paths.launch.write_text(json.dumps({"num_nodes": 1, "nproc_per_node": 1, "steps": 5}))
        d = paths.node_logs(0) / "r_abc" / "attempt_0" / "0"
        d.mkdir(parents=True)
        (d / "stdout.log").write_text("step 1\n")
        time.sleep(0.3)
    finally:
        owner.kill()
        owner.wait()
    follower.join(timeout=10)
    assert not follower.is_alive() and out.getvalue() == "[rank 0] step 1\n"


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
        assert done.before is State.RUNNING and done.after is State.ORPHANED  # a sleeper writes no result
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


# --- scale and tune, unchanged, on a test double of the local backend ------------------------


@dataclass(frozen=True, kw_only=True)
class SyntheticRendered:
    spec: LaunchSpec

    @property
    def dry_run_text(self) -> str:
        return f"# synthetic ranks of {self.spec.run_id}\n"


def synthetic_step_s(spec: LaunchSpec) -> float:
    """What the double's ranks take per step: bf16 twice as fast, checkpointing 30% slower."""
    return (0.01 * spec.micro_batch * spec.grad_accum * (0.5 if spec.precision == "bf16" else 1.0)
            * (1.0 if spec.checkpointing == "none" else 1.3))


@dataclass(frozen=True, kw_only=True)
class SyntheticHandle:
    spec: LaunchSpec

    def follow(self, console: IO[str]) -> Ended:
        s = self.spec
        write_run(Path(s.run_dir), spec=s, world_size=s.world_size, steps=s.steps, warmup=s.warmup_steps,
                  micro_batch=s.micro_batch, grad_accum=s.grad_accum, ranks_per_node=s.gpus,
                  step_s=synthetic_step_s(s), result=None)
        console.write(f"synthetic ranks of {s.run_id}\n")
        return Ended(exit_code=0)


@dataclass
class SyntheticBackend:
    """Ranks that write their files the way tests/synthetic.py does: no torchrun."""

    name: str = "local"
    started: list[LaunchSpec] = field(default_factory=list)

    def claims(self, ref: str) -> bool:
        return False

    def place(self, ask: Ask) -> Placement:
        sizes = parse_world_sizes(ask.sizes) if ask.sizes is not None else [ask.gpus or 1]
        return Placement(device="cpu", gpus=max(sizes), shapes=point_shapes(sizes, None))

    def render(self, spec: LaunchSpec, placement: Placement) -> SyntheticRendered:
        return SyntheticRendered(spec=spec)

    def start(self, rendered: SyntheticRendered, *, attempt: int = 0, debug: bool = False,
              note: str | None = None, progress: object = None) -> SyntheticHandle:
        self.started.append(rendered.spec)
        return SyntheticHandle(spec=rendered.spec)


@pytest.fixture
def on_the_double(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SyntheticBackend:
    """The CLI's registry with the double as its local backend; a cache of this test's own (the
    tune stores what it learnt there), seeded with this host's probes so nothing is measured."""
    from launcher.cli import prepare
    from launcher.plan.resolve import cache_root

    cache = tmp_path / "cache"
    for kind in ("cpu-probe", "steps", "profiles"):
        if (cache_root() / kind).is_dir():
            shutil.copytree(cache_root() / kind, cache / kind)
    monkeypatch.setenv("DLAUNCH_CACHE_DIR", str(cache))
    double = SyntheticBackend()
    monkeypatch.setattr(prepare, "BACKENDS", {"slurm": SlurmBackend(), "local": double})
    return double


TINY_MLP = (str(REPO / "workloads" / "mlp.py"), "--steps", "6")
TINY_ARGS = ("--", "--features", "32", "--hidden", "32", "--depth", "1")


def test_scale_runs_its_points_on_a_test_double_backend(on_the_double: SyntheticBackend, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]):
    from launcher.cli.main import main
    from launcher.report.scaling import build_report

    sweep = tmp_path / "sw"
    assert main(["scale", *TINY_MLP, "--gpus", "1,2", "--sweep-dir", str(sweep), "--no-report", "--json",
                 *TINY_ARGS]) == 0
    assert [(s.world_size, s.run_dir) for s in on_the_double.started] == [
        (1, str(sweep / "ws1-r0")), (2, str(sweep / "ws2-r0"))]
    printed = json.loads(capsys.readouterr().out)
    assert [(p["name"], p["status"]) for p in printed["points"]] == [("ws1-r0", "ok"), ("ws2-r0", "ok")]
    manifest = read_manifest(sweep)
    assert manifest is not None and [(p.name, p.status, p.attempts) for p in manifest.points] == [
        ("ws1-r0", "ok", 1), ("ws2-r0", "ok", 1)]
    step_s = synthetic_step_s(on_the_double.started[0])
    assert manifest.points[0].step_time_median_s == pytest.approx(step_s)
    for point, n in zip(manifest.points, (1, 2)):
        result = json.loads(RunPaths(root=sweep / point.name).result.read_text())
        assert result["status"] == "ok" and result["world_size"] == n
        assert result["samples_per_s"] == pytest.approx(n * point.micro_batch / step_s)
    rows = build_report(sweep, with_prediction=False).rows
    assert [r.world_size for r in rows] == [1, 2] and rows[1].efficiency == pytest.approx(1.0)
    # the same command again resumes: every point is done, nothing starts
    assert main(["scale", *TINY_MLP, "--gpus", "1,2", "--sweep-dir", str(sweep), "--no-report",
                 *TINY_ARGS]) == 0
    assert len(on_the_double.started) == 2


def test_tune_runs_its_trials_on_a_test_double_backend(on_the_double: SyntheticBackend, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]):
    from launcher.cli.main import main

    tune_dir = tmp_path / "tune"
    assert main(["tune", *TINY_MLP, "--gpus", "2", "--trials", "3", "--tune-dir", str(tune_dir), "--json",
                 *TINY_ARGS]) == 0
    printed = json.loads(capsys.readouterr().out)
    trials = printed["trials"]
    assert len(trials) == len(on_the_double.started) >= 1
    assert [t["run_dir"] for t in trials] == [s.run_dir for s in on_the_double.started]
    assert all(t["status"] == "ok" for t in trials)
    for t, s in zip(trials, on_the_double.started):
        assert (t["precision"], t["micro_batch"]) == (s.precision, s.micro_batch)
        assert t["measured_samples_per_s"] == pytest.approx(s.global_batch / synthetic_step_s(s))
    best = max(trials, key=lambda t: t["measured_samples_per_s"])
    assert printed["chosen"] == best["name"] and best["chosen"] is True
    tuned = json.loads(TunePaths(root=tune_dir).tuned_plan.read_text())
    assert tuned["name"] == best["name"] and tuned["measured_samples_per_s"] == best["measured_samples_per_s"]
    assert json.loads(TunePaths(root=tune_dir).record.read_text())["chosen"] == best["name"]


def test_a_progress_bar_reaches_the_console_every_ten_seconds_and_at_100_percent():
    from launcher.backends.local import BarThrottle

    t = [0.0]
    bars = BarThrottle(clock=lambda: t[0])
    line = "[rank 0]  {}%|██        | {}/6 [00:00<00:00, 15.70it/s]\n"
    kept = []
    for i, pct in enumerate((0, 17, 33, 50, 67, 83)):
        t[0] = i * 3.0  # a redraw every 3 s
        kept.append(bars.keep(line.format(pct, i)))
    assert kept == [True, False, False, False, True, False]  # 0 s, then 12 s
    assert bars.keep(line.format(100, 6)) and bars.keep("[rank 1]  17%|█▋ | 1/6 [00:00<00:00]\n")
    assert not bars.keep("[rank 0] \n") and not bars.keep("[rank 0]                      \n")
    assert bars.keep("[rank 0] {'loss': 5.5}\n") and bars.keep("[rank 0] 50% of the data read\n")
    assert bars.keep(line.format(17, 1).rstrip("\n") + "[rank 0] {'loss': 5.5}\n")  # joined: kept whole

"""`dlaunch run` without argv: write the launch spec, render, launch, aggregate, summarise.

A failed attempt may be relaunched (`--max-restarts N`): a new torchrun with a fresh
rendezvous in the same run dir. torchrun's own in-place restart is not used: with gloo its
ranks failed to reconnect in 4 of 9 tries. Before a relaunch the failed
attempt's rank files and logs move to `attempts/<n>/` (with its result.json), so the run dir's
top level always describes the latest attempt and re-aggregating it gives the same result.
The ranks see DLAUNCH_ATTEMPT=<n> and DLAUNCH_RESUME=1 on a relaunch; resuming from a
checkpoint (rather than starting over) needs a checkpointing harness (runtime.checkpoint).

`LocalBackend` (at the end) is the local implementation of `launcher.backends.base.Backend`:
render, start and follow wrap the functions here; status, logs and cancel of a local run dir
are in `launcher.backends.localrun`.

Never imports cli or runtime (the ranks are reached through files only).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shlex
import shutil
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from launcher.backends import local, localrun
from launcher.backends.base import Cancelled, JobStatus, Rendered
from launcher.backends.monitor import Stall
from launcher.backends.postmortem import write_missing_summaries
from launcher.backends.progress import ProgressSpec
from launcher.errors import StorageError
from launcher.files import atomic_write_json, read_json
from launcher.results.aggregate import aggregate
from launcher.results.prediction import plan_step_time_s
from launcher.results.table import format_run
from launcher.results.types import RunResult
from launcher.rundir import RunPaths
from launcher.secrets import mask_env, masked_spec_dict
from launcher.specs import LaunchSpec

if TYPE_CHECKING:  # a type only: jobs never imports the request code
    from launcher.request import RunRequest

log = logging.getLogger(__name__)


def dry_run_text(spec: LaunchSpec, rendered: local.Rendered) -> str:
    """What `--dry-run` prints: the command, the environment dlaunch adds, and the spec.

    Secret-looking variables (see launcher.secrets) are masked.
    """
    env = "\n".join(f"  {k}={v}" for k, v in sorted(mask_env(rendered.env).items()))
    restarts = (f"# up to {spec.max_restarts} restart(s); each adds DLAUNCH_ATTEMPT=<n> "
                "DLAUNCH_RESUME=1\n" if spec.max_restarts else "")
    return (f"# command\n{shlex.join(rendered.argv)}\n# environment added for the ranks\n{env}\n"
            f"{restarts}# launch spec ({RunPaths(root=spec.run_dir).launch})\n"
            f"{json.dumps(masked_spec_dict(spec), indent=2)}\n")


def progress_spec(spec: LaunchSpec) -> ProgressSpec:
    """What the live line measures `spec` against: its steps and batch, and from the plan
    beside the run (if any) the predicted step time and the tokens per sample."""
    path = RunPaths(root=spec.run_dir).plan
    predicted = units = None
    unit = "samples"
    try:
        plan = read_json(path) if path.exists() else None
        if isinstance(plan, dict):
            predicted = plan_step_time_s(plan)
            profile = plan.get("profile") or {}
            if profile.get("sample_units") == "tokens":
                units, unit = int(profile["units_per_sample"]), "tokens"
    except (OSError, KeyError, TypeError, ValueError) as e:  # an older plan file: no comparison
        log.debug("plan.json gives no prediction for the progress line: %s", e)
    return ProgressSpec(total_steps=spec.steps, warmup_steps=spec.warmup_steps,
                        samples_per_step=spec.global_batch, units_per_sample=units or 1, unit=unit,
                        predicted_step_s=predicted)


def run_local(spec: LaunchSpec, *, as_json: bool = False, debug: bool = False,
              out: IO[str] = sys.stdout, rendered: local.Rendered | None = None,
              progress: bool = False) -> RunResult:
    """Launch `spec` with torchrun on this host and return the aggregated result.

    Writes `launch.json` before and `result.json` after; rank output streams to `out`
    (to stderr when `as_json`, so stdout carries only the JSON). `rendered`: the command
    already rendered for `spec` (rendered here when not given). `progress`: a live progress line
    (launcher.backends.progress) with the plan's step time when the run dir holds plan.json.
    """
    rendered = rendered or local.render(spec)
    run_dir = Path(spec.run_dir)
    paths = RunPaths(root=run_dir)
    atomic_write_json(paths.launch, masked_spec_dict(spec))
    console = sys.stderr if as_json else out
    t0 = time.monotonic()
    stopped = ""  # how far an interrupted run got
    history: list[dict[str, Any]] = []
    warned: list[str] = []  # the launcher's warnings over every attempt
    attempt = 0
    while True:
        extra = {"DLAUNCH_ATTEMPT": str(attempt), "DLAUNCH_RESUME": "1"} if attempt else {}
        outcome = local.launch(rendered, spec, console=console, debug=debug, extra_env=extra,
                               attempt=attempt,
                               progress=progress_spec(spec) if progress and not spec.is_script else None)
        stall = outcome.stall
        if outcome.interrupted is not None:
            stall = Stall(kind="interrupted", steps={}, ranks=(),
                          message=f"{signal.Signals(outcome.interrupted).name} to dlaunch")
        if outcome.warnings:
            warned = [*warned, *(w for w in outcome.warnings if w not in warned)]
            _keep_warnings(paths, warned, console)
        try:
            write_missing_summaries(run_dir, spec.world_size, expected_steps=spec.steps,
                                    beats=dict(outcome.beats), stall=stall,
                                    stacks=dict(outcome.stacks), torchrun_log=outcome.torchrun_log)
        except StorageError as e:  # a full disk must not cost the summary of what was recorded
            local.say(console, f"dlaunch: the summaries of ranks that died were not written: {e}\n")
        result = aggregate(run_dir, exit_code=outcome.exit_code, wall_time_s=time.monotonic() - t0)
        if outcome.interrupted is not None:
            result, stopped = interrupted(result, outcome.interrupted, steps=spec.steps)
            break
        if result.status == "ok" or attempt >= spec.max_restarts:
            break
        why = result.failures[0] if result.failures else f"exit code {result.exit_code}"
        history.append({"attempt": attempt, "exit_code": result.exit_code, "failure": why})
        _archive_attempt(run_dir, attempt, result)
        attempt += 1
        local.say(console, f"dlaunch: attempt {attempt - 1} failed ({why}); restarting with a "
                           f"fresh rendezvous ({attempt} of {spec.max_restarts})\n")
    if history:
        history.append({"attempt": attempt, "exit_code": result.exit_code,
                        "failure": result.failures[0] if result.failures else None})
        atomic_write_json(paths.attempts_record, {"attempts": history})
    try:
        atomic_write_json(paths.result, result.to_dict())
    except StorageError as e:
        # the job started: a run that could not be recorded failed (exit 1), said in one line
        why = f"result.json not written: {e}; the rank files keep every record already written"
        result = dataclasses.replace(result, status="failed", exit_code=result.exit_code or 1,
                                     failures=(*result.failures, why))
    if as_json:
        out.write(json.dumps(result.to_dict(), indent=2) + "\n")
    else:
        out.write(format_run(result) + "\n")
        if stopped:
            out.write(stopped + "\n")
        if history:
            out.write(f"restarts: {len(history) - 1} (earlier attempts in "
                      f"{paths.attempts}/, see {paths.attempts_record.name})\n")
    return result


def _keep_warnings(paths: RunPaths, warned: list[str], console: IO[str]) -> None:
    """Keep the launcher's warnings in the run dir, where `aggregate` reads them."""
    try:
        atomic_write_json(paths.launcher_warnings, warned)
    except StorageError as e:  # the warnings were printed; the result must still be written
        local.say(console, f"dlaunch: the launcher's warnings were not kept: {e}\n")


def interrupted(result: RunResult, signum: int, *, steps: int) -> tuple[RunResult, str]:
    """A run the user stopped: status `interrupted`, exit 128 + the signal (130 for Ctrl-C),
    no rank failures (every rank was stopped on purpose); and the line saying how far it got."""
    done = sorted({r.steps for r in result.ranks})
    got = (f"{done[0]}" if len(done) == 1 else f"{done[0]}-{done[-1]}") if done else "0"
    line = (f"interrupted by {signal.Signals(signum).name} after {got} of {steps} step(s); the "
            "rank files keep what was measured")
    return dataclasses.replace(result, status="interrupted", exit_code=128 + signum,
                               failures=()), line


def _archive_attempt(run_dir: Path, attempt: int, result: RunResult) -> None:
    """Move one attempt's rank files and logs to attempts/<attempt>/ with its result."""
    paths = RunPaths(root=run_dir)
    dest = paths.attempt(attempt)
    dest.root.mkdir(parents=True, mode=0o750)
    atomic_write_json(dest.result, result.to_dict())
    for path in paths.attempt_files():
        shutil.move(str(path), str(dest.root / path.name))
    log.debug("attempt %d archived in %s", attempt, dest.root)


# --- the local Backend (launcher.backends.base): adapters around render / run_local above ---


@dataclass(frozen=True, kw_only=True)
class LocalRendered:
    """A local run rendered: its spec and the torchrun command."""

    spec: LaunchSpec
    command: local.Rendered

    @property
    def dry_run_text(self) -> str:
        """What `dlaunch run --dry-run` prints."""
        return dry_run_text(self.spec, self.command)


@dataclass(frozen=True, kw_only=True)
class LocalHandle:
    """A local run about to run: `follow` runs it to the end (dlaunch is its owner)."""

    rendered: LocalRendered
    as_json: bool = False
    debug: bool = False
    quiet: bool = False  # no live progress line

    def follow(self, out: IO[str]) -> RunResult:
        """Run torchrun to the end (restarts included) and print the summary on `out`."""
        return run_local(self.rendered.spec, as_json=self.as_json, debug=self.debug, out=out,
                         rendered=self.rendered.command, progress=not self.quiet)


class LocalBackend:
    """torchrun on this host; a run is its run dir (owner.json names the dlaunch running it)."""

    name = "local"

    def claims(self, ref: str) -> bool:
        """Any directory: the SLURM backend, asked first, claims those with slurm.json."""
        return Path(ref).expanduser().is_dir()

    def render(self, spec: LaunchSpec, request: RunRequest | None = None) -> LocalRendered:
        """The torchrun command for `spec` (the request adds nothing a local run needs)."""
        return LocalRendered(spec=spec, command=local.render(spec))

    def start(self, rendered: Rendered, *, as_json: bool = False, debug: bool = False,
              note: str | None = None, quiet: bool = False) -> LocalHandle:
        """Nothing to submit: the run starts, in this process, when it is followed."""
        if not isinstance(rendered, LocalRendered):
            raise TypeError(f"the local backend cannot start {type(rendered).__name__}")
        spec = rendered.spec
        if spec.device == "cpu":
            print(f"dlaunch: no CUDA GPU on this machine; running {spec.nproc_per_node} CPU "
                  "process(es) with gloo", file=sys.stderr)
        if note:
            print(note, file=sys.stderr)
        return LocalHandle(rendered=rendered, as_json=as_json, debug=debug, quiet=quiet)

    def status(self, ref: str) -> JobStatus:
        """From the run dir's files: see launcher.backends.localrun."""
        st = localrun.read_state(localrun.run_dir_of(ref))
        lines = [f"run {st.run_dir}: {st.state.value}" + (f" ({st.reason})" if st.reason else "")]
        result = _result_of(st.result)
        if result is not None:
            lines.append(format_run(result))
        else:
            lines.append(localrun.progress_line(st))
        data = {"run_dir": str(st.run_dir), "state": st.state.value, "reason": st.reason,
                "pid": st.pid, "host": st.host, "steps": {str(r): s for r, s in st.steps.items()},
                "total_steps": st.total_steps, "last_heartbeat_s": st.beat_age_s,
                "step_s": st.step_s,
                "result": result.to_dict() if result is not None else None}
        return JobStatus(state=st.state, reason=st.reason, run_dir=str(st.run_dir),
                         steps=st.steps, total_steps=st.total_steps,
                         text="\n".join(ln for ln in lines if ln), data=data)

    def logs(self, ref: str, *, out: IO[str], rank: int | None = None,
             follow: bool = False) -> None:
        """torchrun's per-rank log files (logs/node-0/...)."""
        localrun.logs(localrun.run_dir_of(ref), out=out, rank=rank, follow=follow)

    def cancel(self, ref: str) -> Cancelled:
        """SIGTERM to the owning dlaunch, which stops the job and writes its result."""
        return localrun.cancel(localrun.run_dir_of(ref))


def _result_of(data: Mapping[str, Any] | None) -> RunResult | None:
    """result.json's content as a RunResult; None when absent or not one (hand-edited)."""
    if not data:
        return None
    try:
        return RunResult.from_dict(data)
    except (KeyError, TypeError, ValueError, AttributeError):
        return None

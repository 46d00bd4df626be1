"""The one driver of a launch, whatever backend runs it: `launch(rendered, backend, console)`.

It writes launch.json, starts the rendered run through its backend, follows it to its end
(`Handle.follow` -> `Ended`) and records its result (`launch`); `run`, `lab`, `scale`'s points,
`tune`'s trials and `doctor` all launch through it. `status` settles a detached job's result the
first time it is seen over.

A failed attempt may be relaunched (`--max-restarts N`, where the backend says it can be):
a new torchrun with a fresh rendezvous in the same run dir. torchrun's own in-place restart is
not used: with gloo its ranks failed to reconnect in 4 of 9 tries. Before a relaunch the failed
attempt's rank files and logs move to `attempts/<n>/` (with its result.json), so the run dir's
top level always describes the latest attempt and re-aggregating it gives the same result.
The ranks see DLAUNCH_ATTEMPT=<n> and DLAUNCH_RESUME=1 on a relaunch; resuming from a
checkpoint (rather than starting over) needs a checkpointing harness (runtime.checkpoint).
Never imports cli or runtime (the ranks are reached through files only).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

from launcher.backends.base import Backend, Ended, JobStatus, Placement, Rendered
from launcher.backends.local import say
from launcher.backends.monitor import Stall
from launcher.backends.postmortem import write_missing_summaries
from launcher.backends.progress import ProgressSpec
from launcher.errors import LaunchError, StorageError
from launcher.files import atomic_write_json, read_json
from launcher.plan.planfile import read_plan
from launcher.results.aggregate import aggregate
from launcher.results.table import format_run
from launcher.results.types import RunResult
from launcher.rundir import RunPaths
from launcher.runspec import LaunchSpec
from launcher.secrets import masked_spec_dict

log = logging.getLogger(__name__)


def progress_spec(spec: LaunchSpec) -> ProgressSpec:
    """What the live line measures `spec` against: its steps and batch, and from the plan
    beside the run (if any) the predicted step time and the tokens per sample."""
    path = RunPaths(root=spec.run_dir).plan
    predicted, units, unit = None, None, "samples"
    try:
        data = read_json(path) if path.exists() else None
        if isinstance(data, dict):
            plan = read_plan(data)
            predicted = plan.time.step_time_s if plan.time is not None else None
            if plan.sample_units == "tokens":
                units, unit = plan.units_per_sample, "tokens"
    except (OSError, KeyError, TypeError, ValueError) as e:  # an older plan file: no comparison
        log.debug("plan.json gives no prediction for the progress line: %s", e)
    return ProgressSpec(total_steps=spec.steps, warmup_steps=spec.warmup_steps, samples_per_step=spec.global_batch,
                        units_per_sample=units or 1, unit=unit, predicted_step_s=predicted)


def launch(rendered: Rendered, backend: Backend, console: IO[str], *, out: IO[str] | None = None,
           as_json: bool = False, debug: bool = False, note: str | None = None,
           quiet: bool = False) -> RunResult | None:
    """Start `rendered` on `backend`, follow it to its end (restarts included) and return the
    aggregated result; None for a job left running (--detach). Writes `launch.json` before and
    `result.json` after; the ranks' output and progress go to `console`, the summary to `out`
    (default: the console), as JSON with `as_json`. `note` (the plan's) is printed once the
    backend accepted the run; `quiet`: no live progress line."""
    spec = rendered.spec
    out = console if out is None else out
    run_dir = Path(spec.run_dir)
    paths = RunPaths(root=run_dir)
    atomic_write_json(paths.launch, masked_spec_dict(spec))  # secrets never land in the clear
    progress = None if quiet or spec.is_script else progress_spec(spec)
    t0 = time.monotonic()
    history: list[dict[str, Any]] = []
    warned: list[str] = []  # the launcher's warnings over every attempt
    attempt = 0
    while True:
        ended = backend.start(rendered, attempt=attempt, debug=debug, note=note, progress=progress).follow(console)
        if (ref := ended.detached) is not None:  # a job left running: its reference, run dir, how to follow it
            out.write(json.dumps({"job_id": ref, "run_dir": spec.run_dir}) + "\n" if as_json else
                      f"submitted job {ref}\nrun dir: {spec.run_dir}\nfollow with: dlaunch status {ref} "
                      f"| dlaunch logs {ref} --follow | dlaunch cancel {ref}\n")
            return None
        if ended.warnings:
            warned = [*warned, *(w for w in ended.warnings if w not in warned)]
            _keep_warnings(paths, warned, console)
        result = _aggregate(run_dir, ended, spec, console, wall_time_s=time.monotonic() - t0)
        # a backend whose jobs restart themselves (SLURM requeues them) is never relaunched here
        if (ended.interrupted is not None or result.status == "ok" or not ended.restartable
                or attempt >= spec.max_restarts):
            break
        why = result.failures[0] if result.failures else f"exit code {result.exit_code}"
        history.append({"attempt": attempt, "exit_code": result.exit_code, "failure": why})
        _archive_attempt(run_dir, attempt, result)
        attempt += 1
        say(console, f"dlaunch: attempt {attempt - 1} failed ({why}); restarting with a "
                     f"fresh rendezvous ({attempt} of {spec.max_restarts})\n")
    if history:
        history.append({"attempt": attempt, "exit_code": result.exit_code,
                        "failure": result.failures[0] if result.failures else None})
        atomic_write_json(paths.attempts_record, {"attempts": history})
    result = _write_result(paths, result)
    if as_json:
        out.write(json.dumps(result.to_dict(), indent=2) + "\n")
        return result
    out.write(format_run(result) + "\n")
    if ended.interrupted is not None:
        out.write(_how_far(result, ended.interrupted, steps=None if spec.is_script else spec.steps) + "\n")
    if history:
        out.write(f"restarts: {len(history) - 1} (earlier attempts in "
                  f"{paths.attempts}/, see {paths.attempts_record.name})\n")
    if ended.after:
        out.write(ended.after + "\n")
    return result


def _aggregate(run_dir: Path, ended: Ended, spec: LaunchSpec, console: IO[str], *, wall_time_s: float) -> RunResult:
    """The attempt's RunResult: the summaries of ranks that died written first, then the rank
    files aggregated, as the backend's `ended` says (interrupted, its own failure line)."""
    stall = ended.stall
    if ended.interrupted is not None:
        stall = Stall(kind="interrupted", steps={}, ranks=(),
                      message=f"{signal.Signals(ended.interrupted).name} to dlaunch")
    full = None  # the run dir's disk refused the summaries: the likely cause of it all
    if ended.evidence is not None:
        ev = ended.evidence
        try:
            write_missing_summaries(run_dir, spec.world_size, expected_steps=None if spec.is_script else spec.steps,
                                    beats=dict(ev.beats),
                                    stall=stall, stacks=dict(ev.stacks), torchrun_log=ev.torchrun_log)
        except StorageError as e:  # a full disk must not cost the summary of what was recorded
            full = f"the ranks' summaries were not written: {e}"
    result = aggregate(run_dir, exit_code=ended.exit_code,
                       wall_time_s=ended.wall_time_s if ended.wall_time_s is not None else wall_time_s)
    if full is not None:
        result = dataclasses.replace(result, status="failed", failures=(full, *result.failures))
    if ended.interrupted is not None:
        # stopped on purpose: exit 128 + the signal (130 for Ctrl-C), no rank failures
        result = dataclasses.replace(result, status="interrupted", exit_code=128 + ended.interrupted, failures=())
    if ended.failure is not None:
        result = dataclasses.replace(result, status="failed", failures=(ended.failure, *result.failures))
    return result


def _how_far(result: RunResult, signum: int, *, steps: int | None) -> str:
    """How far an interrupted run got (of `steps`; None: a plain script's own count, unknown)."""
    done = sorted({r.steps for r in result.ranks})
    got = (f"{done[0]}" if len(done) == 1 else f"{done[0]}-{done[-1]}") if done else "0"
    of = "" if steps is None else f" of {steps}"
    return (f"interrupted by {signal.Signals(signum).name} after {got}{of} step(s); the "
            "rank files keep what was measured")


def add_warnings(run_dir: str | Path, result: RunResult, lines: list[str]) -> RunResult:
    """`result` with `lines` added to its warnings, in result.json too (what went wrong after
    the result was written: a tracker dropped at the end)."""
    return _write_result(RunPaths(root=run_dir), dataclasses.replace(result, warnings=(*result.warnings, *lines)))


def _write_result(paths: RunPaths, result: RunResult) -> RunResult:
    """result.json; a run that could not be recorded failed (exit 1), said in one line."""
    try:
        atomic_write_json(paths.result, result.to_dict())
    except StorageError as e:
        why = f"result.json not written: {e}; the rank files keep every record already written"
        return dataclasses.replace(result, status="failed", exit_code=result.exit_code or 1,
                                   failures=(*result.failures, why))
    return result


def _keep_warnings(paths: RunPaths, warned: list[str], console: IO[str]) -> None:
    """Keep the launcher's warnings in the run dir, where `aggregate` reads them."""
    try:
        atomic_write_json(paths.launcher_warnings, warned)
    except StorageError as e:  # the warnings were printed; the result must still be written
        say(console, f"dlaunch: the launcher's warnings were not kept: {e}\n")


def _archive_attempt(run_dir: Path, attempt: int, result: RunResult) -> None:
    """Move one attempt's rank files and logs to attempts/<attempt>/ with its result."""
    paths = RunPaths(root=run_dir)
    dest = paths.attempt(attempt)
    dest.root.mkdir(parents=True, mode=0o750)
    atomic_write_json(dest.result, result.to_dict())
    for path in paths.attempt_files():
        shutil.move(str(path), str(dest.root / path.name))
    log.debug("attempt %d archived in %s", attempt, dest.root)


def settle(run_dir: Path, ended: Ended) -> RunResult:
    """The result of a run that ended while nobody followed it (a detached job), written once."""
    spec = LaunchSpec.from_dict(read_json(RunPaths(root=run_dir).launch))
    return _write_result(RunPaths(root=run_dir), _aggregate(run_dir, ended, spec, sys.stderr, wall_time_s=0.0))


def read_result(run_dir: str | Path) -> RunResult | None:
    """result.json of a finished run (keys a later version added left out); None when absent
    or not one (hand-edited)."""
    try:
        data = read_json(RunPaths(root=run_dir).result)
        known = {f.name for f in dataclasses.fields(RunResult)}
        return RunResult.from_dict({k: v for k, v in data.items() if k in known}) if data else None
    except (OSError, KeyError, TypeError, ValueError, AttributeError):
        return None


def status(backend: Backend, ref: str) -> JobStatus:
    """The run's status as its backend says, with the run summary once it is over (written to
    result.json the first time a detached run is seen over)."""
    st = backend.status(ref)
    result = read_result(st.run_dir) if st.run_dir is not None and st.state.final else None
    if result is None and st.ended is not None and st.run_dir is not None:
        result = settle(Path(st.run_dir), st.ended)
    if result is None:
        return dataclasses.replace(st, text="\n".join(ln for ln in (st.text, st.progress) if ln))
    return dataclasses.replace(st, text=f"{st.text}\n{format_run(result)}",
                               data={**st.data, "result": result.to_dict()})


class RunOne(Protocol):
    """One run of a lab, a sweep or a tune (`Runner`, or a test's stand-in)."""

    def __call__(self, spec: LaunchSpec, out: IO[str]) -> RunResult:
        """Launch `spec`, its output on `out`; its result."""


@dataclass(frozen=True, kw_only=True)
class Runner:
    """One run of a lab, a sweep or a tune on `backend` at `placement`: `runner(spec, out)` launches
    `spec` through `launch` (its output and summary on `out`), never detached, without a live line."""

    backend: Backend
    placement: Placement

    def __call__(self, spec: LaunchSpec, out: IO[str]) -> RunResult:
        """The run's result (a lab, a sweep or a tune draws its own progress)."""
        result = launch(self.backend.render(spec, self.placement), self.backend, out, quiet=True)
        if result is None:
            raise LaunchError(f"internal: {spec.run_id} was detached")
        return result

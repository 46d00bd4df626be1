"""`dlaunch run` without argv: write the launch spec, render, launch, aggregate, summarise.

A failed attempt may be relaunched (`--max-restarts N`): a new torchrun with a fresh
rendezvous in the same run dir. torchrun's own in-place restart is not used: with gloo its
ranks failed to reconnect in 4 of 9 tries. Before a relaunch the failed
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
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import IO, Any

from launcher.backends import local
from launcher.backends.monitor import Stall
from launcher.backends.postmortem import write_missing_summaries
from launcher.files import atomic_write_json
from launcher.results.aggregate import aggregate
from launcher.results.table import format_run
from launcher.results.types import RunResult
from launcher.rundir import RunPaths
from launcher.secrets import mask_env, masked_spec_dict
from launcher.specs import LaunchSpec

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


def run_local(spec: LaunchSpec, *, as_json: bool = False, debug: bool = False,
              out: IO[str] = sys.stdout) -> RunResult:
    """Launch `spec` with torchrun on this host and return the aggregated result.

    Writes `launch.json` before and `result.json` after; rank output streams to `out`
    (to stderr when `as_json`, so stdout carries only the JSON).
    """
    rendered = local.render(spec)
    run_dir = Path(spec.run_dir)
    paths = RunPaths(root=run_dir)
    atomic_write_json(paths.launch, masked_spec_dict(spec))
    console = sys.stderr if as_json else out
    t0 = time.monotonic()
    stopped = ""  # how far an interrupted run got
    history: list[dict[str, Any]] = []
    attempt = 0
    while True:
        extra = {"DLAUNCH_ATTEMPT": str(attempt), "DLAUNCH_RESUME": "1"} if attempt else {}
        outcome = local.launch(rendered, spec, console=console, debug=debug, extra_env=extra,
                               attempt=attempt)
        stall = outcome.stall
        if outcome.interrupted is not None:
            stall = Stall(kind="interrupted", steps={}, ranks=(),
                          message=f"{signal.Signals(outcome.interrupted).name} to dlaunch")
        write_missing_summaries(run_dir, spec.world_size, expected_steps=spec.steps,
                                beats=dict(outcome.beats), stall=stall,
                                stacks=dict(outcome.stacks), torchrun_log=outcome.torchrun_log)
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
    atomic_write_json(paths.result, result.to_dict())
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

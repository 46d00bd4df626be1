"""`dlaunch run` without argv: write the launch spec, render, launch, aggregate, summarise.

A failed attempt may be relaunched (`--max-restarts N`): a new torchrun with a fresh
rendezvous in the same run dir. torchrun's own in-place restart is not used: with gloo it
failed to reconnect in 4 of 9 tries here (design.md, "Faults"). Before a relaunch the failed
attempt's rank files and logs move to `attempts/<n>/` (with its result.json), so the run dir's
top level always describes the latest attempt and re-aggregating it gives the same result.
The ranks see DLAUNCH_ATTEMPT=<n> and DLAUNCH_RESUME=1 on a relaunch; resuming from a
checkpoint (rather than starting over) needs a checkpointing harness (runtime.checkpoint).
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import IO, Any

from launcher.backends import local
from launcher.backends.postmortem import write_missing_summaries
from launcher.files import atomic_write_json
from launcher.results.aggregate import aggregate
from launcher.results.table import format_run
from launcher.results.types import RunResult
from launcher.secrets import mask_env, masked_spec_dict
from launcher.specs import LaunchSpec

log = logging.getLogger(__name__)

ATTEMPTS_DIR = "attempts"
# what belongs to one attempt: moved aside before a relaunch
_ATTEMPT_FILES = ("rank-*.jsonl", "rank-*.summary.json", "rank-*.heartbeat", "rank-*.stacks",
                  "logs", "result.json")


def dry_run_text(spec: LaunchSpec, rendered: local.Rendered) -> str:
    """What `--dry-run` prints: the command, the environment dlaunch adds, and the spec.

    Secret-looking variables (see launcher.secrets) are masked.
    """
    env = "\n".join(f"  {k}={v}" for k, v in sorted(mask_env(rendered.env).items()))
    restarts = (f"# up to {spec.max_restarts} restart(s); each adds DLAUNCH_ATTEMPT=<n> "
                "DLAUNCH_RESUME=1\n" if spec.max_restarts else "")
    return (f"# command\n{' '.join(rendered.argv)}\n# environment added for the ranks\n{env}\n"
            f"{restarts}# launch spec ({spec.run_dir}/{local.LAUNCH_FILE})\n"
            f"{json.dumps(masked_spec_dict(spec), indent=2)}\n")


def run_local(spec: LaunchSpec, *, as_json: bool = False, debug: bool = False,
              out: IO[str] = sys.stdout) -> RunResult:
    """Launch `spec` with torchrun on this host and return the aggregated result.

    Writes `launch.json` before and `result.json` after; rank output streams to `out`
    (to stderr when `as_json`, so stdout carries only the JSON).
    """
    rendered = local.render(spec)
    run_dir = Path(spec.run_dir)
    atomic_write_json(run_dir / local.LAUNCH_FILE, masked_spec_dict(spec))
    console = sys.stderr if as_json else out
    t0 = time.monotonic()
    history: list[dict[str, Any]] = []
    attempt = 0
    while True:
        extra = {"DLAUNCH_ATTEMPT": str(attempt), "DLAUNCH_RESUME": "1"} if attempt else {}
        outcome = local.launch(rendered, spec, console=console, debug=debug, extra_env=extra,
                               attempt=attempt)
        write_missing_summaries(run_dir, spec.world_size, expected_steps=spec.steps,
                                beats=dict(outcome.beats), stall=outcome.stall,
                                stacks=dict(outcome.stacks), torchrun_log=outcome.torchrun_log)
        result = aggregate(run_dir, exit_code=outcome.exit_code, wall_time_s=time.monotonic() - t0)
        if result.status == "ok" or attempt >= spec.max_restarts:
            break
        why = result.failures[0] if result.failures else f"exit code {result.exit_code}"
        history.append({"attempt": attempt, "exit_code": result.exit_code, "failure": why})
        _archive_attempt(run_dir, attempt, result)
        attempt += 1
        console.write(f"dlaunch: attempt {attempt - 1} failed ({why}); restarting with a fresh "
                      f"rendezvous ({attempt} of {spec.max_restarts})\n")
        console.flush()
    if history:
        history.append({"attempt": attempt, "exit_code": result.exit_code,
                        "failure": result.failures[0] if result.failures else None})
        atomic_write_json(run_dir / "attempts.json", {"attempts": history})
    atomic_write_json(run_dir / "result.json", result.to_dict())
    if as_json:
        out.write(json.dumps(result.to_dict(), indent=2) + "\n")
    else:
        out.write(format_run(result) + "\n")
        if history:
            out.write(f"restarts: {len(history) - 1} (earlier attempts in "
                      f"{run_dir / ATTEMPTS_DIR}/, see attempts.json)\n")
    return result


def _archive_attempt(run_dir: Path, attempt: int, result: RunResult) -> None:
    """Move one attempt's rank files and logs to attempts/<attempt>/ with its result."""
    dest = run_dir / ATTEMPTS_DIR / str(attempt)
    dest.mkdir(parents=True, mode=0o750)
    atomic_write_json(dest / "result.json", result.to_dict())
    for pattern in _ATTEMPT_FILES:
        for path in run_dir.glob(pattern):
            if path.name == "result.json":
                continue
            shutil.move(str(path), str(dest / path.name))
    log.debug("attempt %d archived in %s", attempt, dest)

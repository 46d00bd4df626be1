"""`dlaunch run` without argv: write the launch spec, render, launch, aggregate, summarise."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import IO

from launcher.backends import local
from launcher.files import atomic_write_json
from launcher.report.aggregate import aggregate
from launcher.report.table import format_run
from launcher.specs import LaunchSpec, RunResult

log = logging.getLogger(__name__)


def dry_run_text(spec: LaunchSpec, rendered: local.Rendered) -> str:
    """What `--dry-run` prints: the command, the environment dlaunch adds, and the spec."""
    env = "\n".join(f"  {k}={v}" for k, v in sorted(rendered.env.items()))
    return (f"# command\n{' '.join(rendered.argv)}\n# environment added for the ranks\n{env}\n"
            f"# launch spec ({spec.run_dir}/{local.LAUNCH_FILE})\n"
            f"{json.dumps(spec.to_dict(), indent=2)}\n")


def run_local(spec: LaunchSpec, *, as_json: bool = False, debug: bool = False,
              out: IO[str] = sys.stdout) -> RunResult:
    """Launch `spec` with torchrun on this host and return the aggregated result.

    Writes `launch.json` before and `result.json` after; rank output streams to `out`
    (to stderr when `as_json`, so stdout carries only the JSON).
    """
    rendered = local.render(spec)
    atomic_write_json(Path(spec.run_dir) / local.LAUNCH_FILE, spec.to_dict())
    t0 = time.monotonic()
    code = local.launch(rendered, spec, console=sys.stderr if as_json else out, debug=debug)
    result = aggregate(spec.run_dir, exit_code=code, wall_time_s=time.monotonic() - t0)
    atomic_write_json(Path(spec.run_dir) / "result.json", result.to_dict())
    if as_json:
        out.write(json.dumps(result.to_dict(), indent=2) + "\n")
    else:
        out.write(format_run(result) + "\n")
    return result

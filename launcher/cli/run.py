"""`dlaunch run`: one run on this host (torchrun) or on SLURM nodes (`--slurm`), or its dry run.

Flags -> RunRequest -> LaunchSpec through `launcher.cli.prepare` (which picks the backend:
local torchrun or SLURM), the backend renders it, and the driver (`launcher.drivers.launch`)
starts and follows it. Must never import torch or launcher.runtime.
"""

from __future__ import annotations

import argparse
import sys

from launcher.cli.options import RunOptions, load
from launcher.cli.prepare import build_request, open_run
from launcher.drivers.launch import add_warnings, launch
from launcher.errors import UsageError
from launcher.results.trackers import FINISH_WAIT_S, TrackerFeed, check_trackers, tracker_params
from launcher.rundir import new_run_id


def note(text: str | None) -> None:
    """Print the plan's note (or why there is no plan) to stderr, if there is one."""
    if text:
        print(text, file=sys.stderr)


def cmd_run(args: argparse.Namespace, workload_args: list[str]) -> int:
    """`dlaunch run`: render on the backend the flags pick, then start and follow it through the
    driver; `--dry-run` prints what would start and starts nothing."""
    opts = load(RunOptions, args)
    if opts.log_to:
        if opts.detach:
            raise UsageError(f"--log-to {','.join(opts.log_to)} with --detach: the trackers are fed "
                             "while dlaunch follows the job; drop --detach or --log-to")
        check_trackers(opts.log_to)
    request, place, backend = build_request(opts, workload_args)
    spec = open_run(request, run_id=new_run_id(opts.workload), run_dir=opts.run_dir, dry_run=opts.dry_run)
    rendered = backend.render(spec, place)
    if opts.dry_run:
        note(request.plan_note)
        print(rendered.dry_run_text, end="")
        return 0
    if place.notice:
        print(f"dlaunch: {place.notice}; running {spec.gpus} CPU process(es) with gloo", file=sys.stderr)
    feed = None
    if opts.log_to:
        feed = TrackerFeed(opts.log_to, spec.run_dir, tracker_params(spec))
        feed.start()
    result, wait_s = None, FINISH_WAIT_S
    try:
        result = launch(rendered, backend, sys.stderr if opts.json else sys.stdout, out=sys.stdout,
                        as_json=opts.json, debug=bool(args.debug), note=request.plan_note, quiet=opts.quiet)
    except KeyboardInterrupt:
        wait_s = 0.0  # Ctrl-C: the trackers get no time at the end either
        raise
    finally:
        dropped = feed.finish(result, wait_s=wait_s) if feed is not None else {}
        if dropped and result is not None:
            add_warnings(spec.run_dir, result, [f"--log-to {name}: {why}" for name, why in dropped.items()])
    if result is None:  # a detached SLURM job
        return 0
    return result.exit_code or (0 if result.status == "ok" else 1)  # torchrun's code when it failed

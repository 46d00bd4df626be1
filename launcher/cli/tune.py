"""`dlaunch tune`: plan, run the candidates the model cannot tell apart, keep the fastest.

Flags -> RunRequest through `launcher.cli.prepare` (as `run`), the uncorrected plan's near-best
candidates (`launcher.jobs.tune.select_trials`), one short `dlaunch run` each, the table, the
tuned plan, and the trials stored as this machine's step-time corrections. Must never import
torch or launcher.runtime.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from launcher.cli.prepare import build_request, open_run, options
from launcher.errors import UsageError
from launcher.jobs.tune import finish, format_tune, run_trials, select_trials, trial_records
from launcher.plan.resolve import plan_workload, store_tune_trials
from launcher.rundir import new_run_id
from launcher.specs import Goal

log = logging.getLogger(__name__)


def cmd_tune(args: argparse.Namespace, workload_args: list[str]) -> int:
    """`dlaunch tune`: the trials, the table, tuned-plan.json and the correction cache."""
    values = options("tune", args)
    if values["slurm"]:
        raise UsageError("tune --slurm: not available yet (run tune on one node of the partition)")
    request, _ = build_request("tune", values, workload_args)
    if request.is_script or request.planned is None:
        raise UsageError(f"dlaunch tune needs a workload file, and {values['workload']!r} is a plain script")
    # the model itself, not corrected by earlier tunes: the ratios stored must be against it
    planned = plan_workload(request.workload, request.workload_args, request.planned.topology,
                            Goal(global_batch=request.global_batch), corrected=False)
    candidates = select_trials(planned.plan, request.device, values["trials"])
    base = open_run(request, run_id="tune-" + new_run_id(values["workload"]), run_dir=values["tune_dir"],
                    dry_run=False, keep_plan=False)
    print(f"dlaunch tune: {len(candidates)} candidate(s) within the model's uncertainty of the best, "
          f"{base.steps} steps each ({base.warmup_steps} warm-up), in {base.run_dir}", file=sys.stderr)
    budget_s = values["budget_min"] * 60 if values["budget_min"] else None
    trials = run_trials(base, candidates, budget_s=budget_s)
    tune = finish(base, trials, workload=request.workload, workload_args=request.workload_args)
    records = trial_records(tune, request.workload)
    if records:
        where = store_tune_trials(planned.topology, records)
        print(f"dlaunch tune: {len(records)} measured/predicted ratio(s) stored for this machine in "
              f"{where}; `dlaunch plan` uses them (--no-calibration-cache ignores them)", file=sys.stderr)
    print(json.dumps(tune.to_dict(), indent=2) if values["json"] else format_tune(tune))
    return 0 if tune.tuned_plan else 1

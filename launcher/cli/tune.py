"""`dlaunch tune`: plan, run the candidates the model cannot tell apart, keep the fastest.

Flags -> RunRequest through `launcher.cli.prepare` (as `run`), the uncorrected plan's near-best
candidates (`launcher.drivers.tune.select_trials`), one short `dlaunch run` each through the
driver on the backend the flags pick (with `--slurm` one `dlaunch run --slurm` job each,
followed in turn: why, in `launcher.drivers.tune`), the table, the tuned plan, and the trials
stored as this machine's (or partition's) step-time corrections, unless another tune ran here
meanwhile (`corrections.TuneLock`). `--dry-run` prints each trial's torchrun command (the sbatch
script and node commands under SLURM) and starts nothing. Must never import torch or runtime.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from pathlib import Path

from launcher.cli.options import TuneOptions, load
from launcher.cli.prepare import build_request, open_run
from launcher.drivers.launch import Runner
from launcher.drivers.tune import (
    discard,
    finish,
    run_trials,
    select_trials,
    trial_name,
    trial_planned,
    trial_records,
    trial_spec,
    trial_steps,
)
from launcher.errors import Refused, UsageError
from launcher.plan.corrections import TuneLock
from launcher.plan.kernels import given as given_kernels
from launcher.plan.planfile import write_plan
from launcher.plan.resolve import cache_root, plan_workload, store_tune_trials
from launcher.plan.types import Overrides
from launcher.report.tune import read_tune, table_text
from launcher.request import weighed_float8
from launcher.rundir import new_run_id
from launcher.specs import Goal


def cmd_tune(args: argparse.Namespace, workload_args: list[str]) -> int:
    """`dlaunch tune`: the trials, the table, tuned-plan.json and the correction cache."""
    opts = load(TuneOptions, args)
    request, place, backend = build_request(opts, workload_args)
    if request.is_script:
        raise UsageError(f"dlaunch tune needs a workload file, and {opts.workload!r} is a plain script")
    if request.planned is None:  # SLURM without a topology of the partition's nodes
        raise UsageError("dlaunch tune --slurm needs --topology FILE (or slurm.topology in dlaunch.yaml) "
                         "describing the partition's nodes: the trials are the plan's candidates for them")
    # the model itself, not corrected by earlier tunes: the ratios stored must be against it
    planned = plan_workload(request.workload, request.workload_args, request.planned.topology,
                            Goal(global_batch=request.global_batch), corrected=False,
                            overrides=Overrides(float8=weighed_float8(None), reduce_dtype=request.reduce_dtype,
                                              **given_kernels(request)))
    candidates = select_trials(planned.plan, request.device, opts.trials)
    if opts.steps is None:
        request = dataclasses.replace(request, steps=trial_steps(candidates, opts.warmup_steps))
    base = open_run(request, run_id="tune-" + new_run_id(opts.workload), run_dir=opts.tune_dir,
                    dry_run=opts.dry_run, keep_plan=False)
    if opts.dry_run:  # each trial's torchrun command, or its sbatch script and node commands
        for i, c in enumerate(candidates, 1):
            spec = trial_spec(base, c, i)
            print(f"# trial {i} of {len(candidates)}: {trial_name(c)} (predicted {c.time.step_time_s:.3g} "
                  f"s/step){'' if place.here else ' as its own SLURM job'}, in {spec.run_dir}")
            print(backend.render(spec, place).dry_run_text, end="")
        return 0
    where = "one after another" if place.here else "one SLURM job each"
    print(f"dlaunch tune: {len(candidates)} candidate(s) within the model's uncertainty of the best, "
          f"{base.steps} steps each ({base.warmup_steps} warm-up), {where}, in {base.run_dir}", file=sys.stderr)
    budget_s = opts.budget_min * 60 if opts.budget_min else None
    # two tunes at once here slow each other's trials: neither's are this machine's correction (a
    # SLURM tune's trials run on the partition's nodes); one lock per machine, beside the corrections
    lock = tune_lock() if place.here else None
    with lock if lock is not None else contextlib.nullcontext():
        if lock is not None and lock.contended:
            print("dlaunch tune: another dlaunch tune is running on this machine: its timings are "
                  "contended, not stored as this machine's correction", file=sys.stderr)
        try:
            trials = run_trials(base, candidates, budget_s=budget_s, run=Runner(backend=backend, placement=place),
                                keep_plan=lambda spec, c: write_plan(spec.run_dir, trial_planned(planned, c)))
        except Refused:
            discard(base.run_dir)  # nothing ran: bad input leaves nothing behind
            raise
        tune = finish(base, trials, workload=request.workload, workload_args=request.workload_args,
                      interval=planned.plan.step_interval)
        records = trial_records(tune, request.workload, request.workload_args)
        contended = lock is not None and lock.contended  # a tune started beside ours knocked
    if records and contended and lock is not None and lock.held:  # the other one said so when it started
        print("dlaunch tune: another dlaunch tune ran on this machine meanwhile: these timings "
              "are contended, not stored as this machine's correction", file=sys.stderr)
    elif records and not contended:
        stored = store_tune_trials(planned.topology, records)
        whose = "this machine" if place.here else f"the partition's nodes ({planned.topology.name})"
        print(f"dlaunch tune: {len(records)} measured/predicted ratio(s) stored for {whose} in {stored}; "
              "`dlaunch plan` uses them (--no-calibration-cache ignores them)", file=sys.stderr)
    if opts.json:
        print(json.dumps(tune.to_dict(), indent=2))
    else:
        summary, notes = read_tune(Path(tune.tune_dir))  # the table its report shows, from tune.json
        print(table_text(summary, Path(tune.tune_dir)) if summary is not None else "\n".join(notes))
    return 0 if tune.tuned_plan else 1


def tune_lock() -> TuneLock:
    """This machine's tune lock: <cache root>/tune.lock."""
    return TuneLock(cache_root() / "tune.lock")

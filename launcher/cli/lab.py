"""`dlaunch lab`: fp32, the plan's mixed precision, and mixed precision + compile, side by side.

The flags of `run` apply to all three runs, except precision and compile, which the lab sets
itself; the runs and their reading are `launcher.drivers.lab`'s, each run launched by the driver
on the backend `launcher.cli.prepare` picks. Must never import torch.
"""

from __future__ import annotations

import argparse
import json
import sys

from launcher.cli.options import LabOptions, load
from launcher.cli.prepare import build_request, open_run
from launcher.cli.run import note
from launcher.drivers.lab import detect_precisions, format_lab, lab_specs, run_lab
from launcher.drivers.launch import Runner
from launcher.rundir import new_run_id


def cmd_lab(args: argparse.Namespace, workload_args: list[str]) -> int:
    """`dlaunch lab`: the three runs back to back, then the table and what it says."""
    opts = load(LabOptions, args)
    request, place, backend = build_request(opts, workload_args)  # precision is never given: planned
    precisions = detect_precisions(request.device, request.precision)
    base = open_run(request, run_id="lab-" + new_run_id(opts.workload), run_dir=opts.run_dir,
                    dry_run=opts.dry_run, keep_plan=False)
    if opts.dry_run:
        for name, spec in lab_specs(base, precisions.mixed, precisions.compile_precision):
            print(f"# {name}\n{backend.render(spec, place).dry_run_text}", end="")
        return 0
    note(request.plan_note)
    print(f"dlaunch lab: {precisions.note}", file=sys.stderr)
    lab = run_lab(base, precisions, run=Runner(backend=backend, placement=place))
    print(json.dumps(lab.to_dict(), indent=2) if opts.json else format_lab(lab))
    return 0 if lab.ok else 1

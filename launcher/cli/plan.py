"""`dlaunch plan`: the recommended strategy, precision and batch for a workload, and why.

Profiles the workload on the meta device (torch is imported there, inside launcher.plan, and
the profile is cached) and plans it for this machine or a --topology file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys

from launcher.cli.prepare import options
from launcher.plan.resolve import plan_workload, resolve_topology
from launcher.plan.view import format_plan
from launcher.specs import Goal
from launcher.workload import inspect_file

log = logging.getLogger(__name__)


def cmd_plan(args: argparse.Namespace, workload_args: list[str]) -> int:
    """`dlaunch plan`: the recommended plan, its predicted memory and time, and the rejects."""
    values = options("plan", args)
    inspect_file(values["workload"])
    topology = resolve_topology(topology=values["topology"], gpus=values["gpus"], nodes=values["nodes"])
    goal = Goal(global_batch=values["global_batch"], seq_len=values["seq_len"])
    overrides = {k: values[k] for k in ("strategy", "precision", "micro_batch") if values[k] is not None}
    if values["checkpointing"] is not None:
        overrides["activation_checkpointing"] = values["checkpointing"]
    if values["compile"] is not None:  # --compile / --no-compile; else the plan decides
        overrides["compile"] = values["compile"]
    planned = plan_workload(values["workload"], workload_args, topology, goal, overrides=overrides,
                            corrected=not values["no_calibration_cache"])
    if values["json"]:
        print(json.dumps({"plan": planned.plan.to_dict(),
                          "profile": dataclasses.asdict(planned.profile),
                          "topology": planned.topology.name}, indent=2, default=str))
    else:
        print(format_plan(planned.plan, planned.profile, planned.topology))
    for reason in planned.plan.reasons:
        if reason.startswith("warning:"):
            print(f"dlaunch: {reason}", file=sys.stderr)
    return 0

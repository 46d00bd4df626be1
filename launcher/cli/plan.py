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

from launcher.cli.options import PlanOptions, load
from launcher.plan.resolve import Planned, plan_workload, resolve_topology
from launcher.plan.time_to_train import GoodputModel, PlanRate, TrainGoal, describe, time_to_train, to_dict
from launcher.plan.view import format_plan
from launcher.specs import Goal
from launcher.workload import inspect_file

log = logging.getLogger(__name__)


def _train_goal(opts: PlanOptions) -> TrainGoal | None:
    """--tokens / --samples / --train-steps, or None without a goal."""
    given = {"tokens": opts.tokens, "samples": opts.samples, "steps": opts.train_steps}
    if all(v is None for v in given.values()):
        return None
    return TrainGoal(**given)


def _rate(planned: Planned) -> PlanRate:
    """What time_to_train needs of the chosen plan."""
    plan, chosen = planned.plan, planned.plan.chosen
    return PlanRate(step_s=chosen.time.step_time_s, global_batch=plan.global_batch,
                    units_per_sample=max(1, planned.profile.units_per_sample),
                    world_size=plan.world_size, devices_per_node=planned.topology.devices_per_node,
                    state_bytes_per_rank=chosen.memory.params_bytes + chosen.memory.optimizer_bytes)


def cmd_plan(args: argparse.Namespace, workload_args: list[str]) -> int:
    """`dlaunch plan`: the recommended plan, its predicted memory and time, and the rejects."""
    opts = load(PlanOptions, args)
    inspect_file(opts.workload)
    topology = resolve_topology(topology=opts.topology, gpus=opts.gpus, nodes=opts.nodes)
    goal = Goal(global_batch=opts.global_batch, seq_len=opts.seq_len)
    given: dict[str, object] = {"strategy": opts.strategy, "precision": opts.precision,
                                "micro_batch": opts.micro_batch, "activation_checkpointing": opts.checkpointing,
                                "compile": opts.compile}  # compile: --compile / --no-compile
    overrides = {k: v for k, v in given.items() if v is not None}  # None: the plan decides
    train_goal = _train_goal(opts)  # checked before the (slow) profile
    planned = plan_workload(opts.workload, workload_args, topology, goal, overrides=overrides,
                            corrected=not opts.no_calibration_cache)
    ttt = None if train_goal is None else time_to_train(train_goal, _rate(planned), GoodputModel(
        **{k: v for k, v in (("mtbf_gpu_hours", opts.mtbf_gpu_hours),
                             ("ckpt_write_gb_s_per_node", opts.ckpt_write_gb_s),
                             ("gpu_hour_price", opts.gpu_hour_price)) if v is not None}))
    if opts.json:
        print(json.dumps({"plan": planned.plan.to_dict(),
                          "profile": dataclasses.asdict(planned.profile),
                          "topology": planned.topology.name,
                          **({"time_to_train": to_dict(ttt)} if ttt is not None else {})},
                         indent=2, default=str))
    else:
        print(format_plan(planned.plan, planned.profile, planned.topology))
        if ttt is not None:
            print("\n".join(describe(ttt, world_size=planned.plan.world_size)))
    for reason in planned.plan.reasons:
        if reason.startswith("warning:"):
            print(f"dlaunch: {reason}", file=sys.stderr)
    return 0

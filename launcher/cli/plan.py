"""`dlaunch plan`: the recommended strategy, precision and batch for a workload, and why.

Profiles the workload on the meta device (torch is imported there, inside launcher.plan, and
the profile is cached) and plans it for this machine or a --topology file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from launcher.cli.options import PlanOptions, load
from launcher.errors import PlanError, UsageError
from launcher.plan.explain import label
from launcher.plan.kernels import given as given_kernels
from launcher.plan.resolve import Planned, plan_workload, resolve_topology
from launcher.plan.sizing import SizeRow, parse_duration_s, parse_world_sizes, pick, with_efficiency
from launcher.plan.time_to_train import (
    GoodputModel,
    PlanRate,
    TrainGoal,
    describe,
    format_duration,
    time_to_train,
    to_dict,
)
from launcher.plan.types import Overrides
from launcher.plan.view import format_plan
from launcher.specs import Goal
from launcher.workload import inspect_file


def _train_goal(opts: PlanOptions) -> TrainGoal | None:
    """--tokens / --samples / --train-steps, or None without a goal."""
    given = {"tokens": opts.tokens, "samples": opts.samples, "steps": opts.train_steps}
    return None if all(v is None for v in given.values()) else TrainGoal(**given)


def _rate(planned: Planned) -> PlanRate:
    """What time_to_train needs of the chosen plan."""
    plan, chosen = planned.plan, planned.plan.chosen
    return PlanRate(step_s=chosen.time.step_time_s, global_batch=plan.global_batch,
                    units_per_sample=max(1, planned.profile.units_per_sample),
                    world_size=plan.world_size, devices_per_node=planned.topology.devices_per_node,
                    state_bytes_per_rank=chosen.memory.params_bytes + chosen.memory.optimizer_bytes)


def _sizes(opts: PlanOptions, workload_args: list[str], goal: Goal, overrides: Overrides,
           train_goal: TrainGoal | None, goodput: GoodputModel) -> int:
    """`dlaunch plan --world-sizes ...`: one plan per size, a table, and the pick if asked."""
    assert opts.world_sizes is not None
    sizes = parse_world_sizes(opts.world_sizes)
    deadline_s = None if opts.deadline is None else parse_duration_s(opts.deadline)
    if (deadline_s is not None or opts.budget is not None) and train_goal is None:
        raise UsageError("--deadline and --budget need a training goal: add --tokens, --samples or --train-steps")
    per_node = resolve_topology(topology=opts.topology, gpus=opts.gpus, nodes=1).devices_per_node
    if bad := [n for n in sizes if n > per_node and n % per_node]:
        raise UsageError(f"--world-sizes {', '.join(map(str, bad))}: not whole nodes of {per_node} "
                         f"GPUs; use multiples of {per_node} above one node")
    rows: list[SizeRow] = []
    plans: dict[int, Planned] = {}
    unfit: dict[int, str] = {}  # world size -> why nothing was planned there
    for n in sizes:
        nodes, gpus = (n // per_node, per_node) if n >= per_node else (1, n)
        topology = resolve_topology(topology=opts.topology, gpus=gpus, nodes=nodes)
        try:
            planned = plan_workload(opts.workload, workload_args, topology, goal, overrides=overrides,
                                    corrected=not opts.no_calibration_cache)
        except PlanError as e:  # nothing fits at this size: the others still plan; none at all is the error
            if n == sizes[-1] and not rows:
                raise
            unfit[n] = str(e)
            continue
        rate = _rate(planned)
        plans[n] = planned
        rows.append(SizeRow(world_size=n, nodes=nodes, label=label(planned.plan.chosen), step_s=rate.step_s,
                            units_per_s=rate.global_batch * rate.units_per_sample / rate.step_s, efficiency=1.0,
                            ttt=None if train_goal is None else time_to_train(train_goal, rate, goodput)))
    rows = with_efficiency(rows)
    chosen, why = (pick(rows, deadline_s=deadline_s, budget=opts.budget)
                   if deadline_s is not None or opts.budget is not None else (None, []))
    unit = "tokens" if plans[rows[0].world_size].profile.sample_units == "tokens" else "samples"
    if opts.json:
        print(json.dumps({"rows": [{**{k: v for k, v in dataclasses.asdict(r).items() if k != "ttt"},
                                    "time_to_train": None if r.ttt is None else to_dict(r.ttt),
                                    "plan": plans[r.world_size].plan.to_dict()} for r in rows],
                          "unit": unit, "chosen": None if chosen is None else chosen.world_size,
                          "why": why, "not_planned": unfit}, indent=2, default=str))
        return 0
    print(_size_table(rows, unit))
    for n, why_not in unfit.items():
        print(f"{n:>6} GPUs: not planned: {why_not}")
    if chosen is not None:
        print("\n".join(["", f"chosen: {why[0]}", *(f"  {w}" for w in why[1:])]))
    if rows[0].ttt is not None:
        print("\n".join(f"assumption: {a}" for a in rows[0].ttt.assumptions))
    return 0


def _size_table(rows: list[SizeRow], unit: str) -> str:
    """The --world-sizes table."""
    w = max(22, *(len(r.label) for r in rows))  # the plan column fits its longest label
    head = f"{'GPUs':>6} {'nodes':>5}  {'plan':<{w}} {'step':>8} {unit + '/s':>14} {'eff.':>5}"
    goal = rows[0].ttt is not None
    priced = goal and all(r.ttt is not None and r.ttt.cost is not None for r in rows)
    if goal:
        head += f" {'time':>10} {'GPU-hours':>11}" + (f" {'cost':>12}" if priced else "") + f" {'goodput':>7}"
    lines = [head]
    for r in rows:
        line = (f"{r.world_size:>6} {r.nodes:>5}  {r.label:<{w}} {r.step_s:>7.3g}s "
                f"{r.units_per_s:>14,.0f} {r.efficiency:>5.0%}")
        if r.ttt is not None:
            line += f" {format_duration(r.ttt.wall_s):>10} {r.ttt.gpu_hours:>11,.0f}"
            if priced and r.ttt.cost is not None:
                line += f" {r.ttt.cost:>12,.0f}"
            line += f" {r.ttt.goodput:>7.1%}"
        lines.append(line)
    return "\n".join(lines)


def cmd_plan(args: argparse.Namespace, workload_args: list[str]) -> int:
    """`dlaunch plan`: the recommended plan, its predicted memory and time, and the rejects."""
    opts = load(PlanOptions, args)
    inspect_file(opts.workload).require_tp_plan(opts.settings.tp)
    topology = resolve_topology(topology=opts.topology, gpus=opts.gpus, nodes=opts.nodes)
    goal = Goal(global_batch=opts.global_batch, seq_len=opts.seq_len)
    given = opts.settings  # None: the plan decides
    overrides = Overrides(strategy=given.strategy, precision=given.precision, micro_batch=given.micro_batch,
                          checkpointing=given.checkpointing, compile=given.compile, tp=given.tp,
                          offload=given.offload, float8=given.float8, reduce_dtype=given.reduce_dtype,
                          fsdp_unit=given.fsdp_unit, **given_kernels(given))
    train_goal = _train_goal(opts)  # checked before the (slow) profile
    goodput = GoodputModel(**{k: v for k, v in (("mtbf_gpu_hours", opts.mtbf_gpu_hours),
                                                ("ckpt_write_gb_s_per_node", opts.ckpt_write_gb_s),
                                                ("gpu_hour_price", opts.gpu_hour_price)) if v is not None})
    if opts.world_sizes is not None:
        return _sizes(opts, workload_args, goal, overrides, train_goal, goodput)
    if opts.deadline is not None or opts.budget is not None:
        raise UsageError("--deadline and --budget choose among --world-sizes; add --world-sizes "
                         "64,128,... and a goal (--tokens)")
    planned = plan_workload(opts.workload, workload_args, topology, goal, overrides=overrides,
                            corrected=not opts.no_calibration_cache)
    ttt = None if train_goal is None else time_to_train(train_goal, _rate(planned), goodput)
    if opts.json:
        print(json.dumps({"plan": planned.plan.to_dict(), "profile": dataclasses.asdict(planned.profile),
                          "topology": planned.topology.name,
                          **({"time_to_train": to_dict(ttt)} if ttt is not None else {})}, indent=2, default=str))
    else:
        print(format_plan(planned.plan, planned.profile, planned.topology))
        if ttt is not None:
            print("\n".join(describe(ttt, world_size=planned.plan.world_size)))
    for reason in planned.plan.reasons:
        if reason.startswith("warning:"):
            print(f"dlaunch: {reason}", file=sys.stderr)
    return 0

"""The planner's search space: candidate strategies, precisions, checkpointing and batches.

Pure functions of the frozen specs (no torch, no I/O); never imports cli, backends, jobs, runtime,
results or report. Each candidate gets its memory (`memory.estimate_memory`) and step time
(`cost.step_time`); ranking and explaining them is `search`'s job.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from launcher.errors import PlanError
from launcher.hardware.types import Topology
from launcher.plan.compile_choice import compiles, worth_compiling
from launcher.plan.compile_probe import CompileCheck
from launcher.plan.cost import attention_flops_fwd, shard_group_size, step_time
from launcher.plan.memory import estimate_memory
from launcher.plan.step_probe import WorkloadTiming
from launcher.plan.types import Candidate, StepTimeEstimate
from launcher.specs import CHECKPOINTING, Goal, ModelProfile, Strategy, checkpointing_mode
from launcher.workload import no_tp_plan

logger = logging.getLogger(__name__)

# Ties go to DDP (fewest moving parts), then to full shard over grad-op: at the same predicted
# speed full shard keeps less in memory (more headroom), and hybrid only wins when faster.
STRATEGY_ORDER = ("ddp", "fsdp_full", "fsdp_grad_op", "hybrid")
# Without --global-batch: power-of-two micro-batches up to this, no accumulation; the best
# throughput wins, which (ties going to the larger micro-batch) is the largest that fits. Beyond
# 64 the gains are small once compute dominates, and large batches need the learning rate
# retuned; users who want more pass --global-batch. On CPU a step's fixed cost (Python, the
# optimizer over every tensor) is amortized by 16 samples (the 0.9M-parameter MLP of
# workloads/mlp.py: 1.4x the samples/s at 16 as at 8, gpt tiny 1.03x); beyond, steps only get
# longer.
DEFAULT_MAX_MICRO_BATCH = {"cuda": 64, "cpu": 16}
# `checkpointing` forces a mode (launcher.specs.CHECKPOINTING). `activation_checkpointing` (a
# bool: true is "full") and `recompute_fraction` (the share of the forward recomputed, instead
# of the mode's own price) are what benchmarks/published/run.py passes for published rows.
OVERRIDE_KEYS = ("strategy", "precision", "micro_batch", "compile", "compile_mode",
                 "checkpointing", "activation_checkpointing", "recompute_fraction", "tp")
# the strategies tensor parallelism composes with on a GPU plan's own initiative (the runtime
# builds a 2-D mesh ("dp", "tp") with FSDP on "dp"); a forced tp may also pair with grad-op
TP_KINDS = ("fsdp_full", "hybrid")


def profile_for_goal(profile: ModelProfile, goal: Goal) -> ModelProfile:
    """`profile` at `goal.seq_len`: activations and matmul FLOPs scale linearly with sequence
    length (exact for SDPA/flash attention, which saves no s x s scores), attention FLOPs
    quadratically."""
    if goal.seq_len is None or goal.seq_len == profile.units_per_sample:
        return profile
    if profile.sample_units != "tokens":
        raise PlanError(f"--seq-len {goal.seq_len} applies to sequence models (tokens per "
                        f"sample); {profile.name} counts {profile.sample_units}: drop --seq-len")
    r = goal.seq_len / profile.units_per_sample
    attention = attention_flops_fwd(profile)
    return dataclasses.replace(
        profile, units_per_sample=goal.seq_len,
        activation_bytes_per_sample=profile.activation_bytes_per_sample * r,
        block_input_bytes_per_sample=profile.block_input_bytes_per_sample * r,
        flops_fwd_per_sample=(profile.flops_fwd_per_sample - attention) * r + attention * r * r,
        attention_flops_fwd_per_sample=attention * r * r,
        conv_flops_fwd_per_sample=profile.conv_flops_fwd_per_sample * r)


def check_overrides(overrides: Mapping[str, Any] | None, topology: Topology) -> dict[str, Any]:
    """The set overrides (None values dropped); PlanError for an unknown or impossible one."""
    ov = {k: v for k, v in (overrides or {}).items() if v is not None}
    unknown = sorted(set(ov) - set(OVERRIDE_KEYS))
    if unknown:
        raise PlanError(f"unknown plan override {', '.join(unknown)}; "
                        f"use {', '.join(OVERRIDE_KEYS)}")
    if ov.get("strategy") == "hybrid" and topology.num_nodes <= 1:
        raise PlanError("strategy hybrid shards inside a node and replicates across nodes: it "
                        "needs more than one node; on one node use fsdp_full")
    if "tp" in ov and (not isinstance(ov["tp"], int) or isinstance(ov["tp"], bool)
                       or ov["tp"] < 1):
        raise PlanError(f"--tp (the tensor-parallel degree) must be an integer >= 1, "
                        f"got {ov['tp']!r}")
    if ov.get("tp", 1) > 1 and ov.get("strategy") == "ddp":
        raise PlanError(f"--tp {ov['tp']} composes tensor parallelism with FSDP on the "
                        "data-parallel dimension; DDP does not: use --strategy fsdp_full or "
                        "hybrid, or drop --tp")
    if "micro_batch" in ov and (not isinstance(ov["micro_batch"], int) or ov["micro_batch"] < 1):
        raise PlanError(f"--micro-batch must be an integer >= 1, got {ov['micro_batch']!r}")
    frac = ov.get("recompute_fraction", 1.0)
    if not isinstance(frac, int | float) or not 0 < frac <= 1:
        raise PlanError(f"recompute_fraction is the share of the forward that checkpointing "
                        f"recomputes, in (0, 1]; got {frac!r}")
    if "activation_checkpointing" in ov:
        legacy = checkpointing_mode(ov.pop("activation_checkpointing"))
        if ov.setdefault("checkpointing", legacy) != legacy:
            raise PlanError(f"checkpointing {ov['checkpointing']} and activation_checkpointing "
                            f"({legacy}) disagree; give one")
    if "checkpointing" in ov:
        ov["checkpointing"] = checkpointing_mode(ov["checkpointing"])
    # Strategy validates kind/precision/compile_mode with an actionable message
    Strategy(kind=ov.get("strategy", "ddp"), precision=ov.get("precision", "fp32"),
             compile_mode=ov.get("compile_mode", "default"))
    return ov


def check_tp(ov: Mapping[str, Any], profile: ModelProfile, topology: Topology) -> None:
    """PlanError, in one line, for a forced tp > 1 the workload or the topology cannot take."""
    tp = ov.get("tp", 1)
    if tp <= 1:
        return
    if not profile.tp_degrees:
        raise PlanError(no_tp_plan(tp, f"workload {profile.name.split()[0]}"))
    if tp not in profile.tp_degrees:
        raise PlanError(f"--tp {tp}: {profile.name.split()[0]}'s tp_plan accepts tp "
                        f"{', '.join(map(str, profile.tp_degrees))} (the degrees that divide "
                        f"its heads); use one of them or drop --tp")
    if topology.devices_per_node % tp:
        raise PlanError(f"--tp {tp} must divide the {topology.devices_per_node} "
                        f"{'GPUs' if topology.device == 'cuda' else 'ranks'} per node "
                        "(tensor parallelism stays inside a node); use a divisor or drop --tp")


def tp_degrees(kind: str, profile: ModelProfile, topology: Topology,
               ov: Mapping[str, Any]) -> list[int]:
    """The TP degrees to try with strategy `kind`: the forced one; else on GPUs 1 and, for
    TP_KINDS, each of the workload's degrees that divides the GPUs per node (tensor parallelism
    over NVLink only); CPU plans try TP only when forced."""
    if "tp" in ov:
        return [ov["tp"]] if ov["tp"] == 1 or kind != "ddp" else []
    if topology.device != "cuda" or kind not in TP_KINDS:
        return [1]
    return [1] + [d for d in profile.tp_degrees
                  if d > 1 and topology.devices_per_node % d == 0]


def _precisions(topology: Topology, ov: Mapping[str, Any]) -> list[str]:
    dev = topology.accelerator
    if "precision" in ov:
        return [ov["precision"]]
    if topology.device == "cpu":
        return ["fp32", "bf16"] if "bf16" in dev.peak_tflops else ["fp32"]
    return ["bf16"] if dev.supports_bf16 else ["fp16"]


def _batches(goal: Goal, n: int, ov: Mapping[str, Any],
             device: str) -> tuple[list[tuple[int, int]], list[int]]:
    """(micro_batch, grad_accum) pairs to try, and micro-batches skipped for divisibility."""
    forced = ov.get("micro_batch")
    if goal.global_batch is None:
        top = DEFAULT_MAX_MICRO_BATCH[device]
        mbs = [forced] if forced else [2**i for i in range(top.bit_length()) if 2**i <= top]
        return [(mb, 1) for mb in mbs], []
    gb = goal.global_batch
    if gb % n:
        raise PlanError(f"global batch {gb} does not split over {n} data-parallel ranks; "
                        f"use a multiple of {n} (e.g. {max(n, gb // n * n)})")
    per_rank = gb // n
    if forced:
        if per_rank % forced:
            raise PlanError(f"micro-batch {forced} x {n} ranks does not divide global batch {gb}"
                            f" ({per_rank} samples per rank); pick a divisor of {per_rank}")
        return [(forced, per_rank // forced)], []
    mbs = sorted({2**i for i in range(per_rank.bit_length()) if 2**i <= per_rank} | {per_rank})
    ok = [(mb, per_rank // mb) for mb in mbs if per_rank % mb == 0]
    return ok, [mb for mb in mbs if per_rank % mb]


def _modes(profile: ModelProfile, ov: Mapping[str, Any]) -> tuple[str, ...]:
    """The checkpointing modes to price: every one (`search` keeps the forced one), or none
    alone for a model without repeated blocks (nothing to wrap: every mode is none)."""
    if profile.num_blocks < 1 and "checkpointing" not in ov:
        return ("none",)
    return CHECKPOINTING


def _timed(profile: ModelProfile, strategy: Strategy, topology: Topology, mb: int, accum: int,
           ov: Mapping[str, Any], timing: WorkloadTiming | None) -> tuple[Strategy, StepTimeEstimate]:
    """`strategy` and its step time; a compile the plan proposed (not the user) is dropped when
    not predicted worth its compile time (`compile_choice.worth_compiling`)."""
    frac = ov.get("recompute_fraction")
    t = step_time(profile, strategy, topology, mb, accum, recompute_fraction=frac, timing=timing)
    if strategy.compile and "compile" not in ov:
        eager = dataclasses.replace(strategy, compile=False)
        t_eager = step_time(profile, eager, topology, mb, accum, recompute_fraction=frac, timing=timing)
        if not worth_compiling(t_eager.step_time_s, t.step_time_s):
            return eager, t_eager
    return strategy, t


def candidates(profile: ModelProfile, topology: Topology, goal: Goal, ov: Mapping[str, Any],
               usable: float, timing: WorkloadTiming | None = None,
               compile_check: CompileCheck | None = None) -> tuple[list[Candidate], list[int]]:
    """Every (strategy, precision, checkpointing mode, micro-batch) the overrides allow, with its
    memory and time (CPU: from the workload's timed steps, `timing`, when measured), and the
    micro-batches skipped because they do not divide the batch. Each strategy compiles as the
    `compile` override says, else where `compile_choice.compiles` proposes it (`compile_check`:
    Dynamo's trace of the workload) and it is predicted worth its compile time."""
    n = topology.world_size
    kinds = [k for k in STRATEGY_ORDER if k != "hybrid" or topology.num_nodes > 1]
    if n == 1 and "strategy" not in ov:
        kinds = ["ddp"]  # one device: nothing to shard over; the runtime runs it unwrapped
    if ov.get("tp", 1) > 1 and "strategy" not in ov:
        kinds = [k for k in kinds if k != "ddp"] or ["fsdp_full"]
    batches, skipped = _batches(goal, n, ov, topology.device) if ov.get("tp", 1) == 1 else ([], [])
    out = []
    for kind in kinds:
        compiled = compiles(kind, topology, ov, compile_check)
        for tp in tp_degrees(kind, profile, topology, ov):
            group = shard_group_size(kind, topology, tp)
            if tp == 1:
                tp_batches = batches
            else:
                # with TP, world / tp ranks take samples: a batch that does not split over them
                # rules this degree out (said by the error when the degree was forced)
                try:
                    tp_batches, tp_skipped = _batches(goal, n // tp, ov, topology.device)
                except PlanError:
                    if "tp" in ov:
                        raise
                    continue
                if "tp" in ov:
                    skipped = tp_skipped
            for precision in _precisions(topology, ov):
                for ckpt in _modes(profile, ov):
                    strategy = Strategy(kind=kind, precision=precision,
                                        checkpointing=ckpt, compile=compiled,
                                        compile_mode=ov.get("compile_mode", "default"), tp=tp)
                    for mb, accum in tp_batches:
                        mem = estimate_memory(profile, strategy, micro_batch=mb, world_size=n,
                                              shard_group_size=group, device=topology.device,
                                              optimizer=goal.optimizer)
                        s, t = _timed(profile, strategy, topology, mb, accum, ov, timing)
                        out.append(Candidate(strategy=s, micro_batch=mb, grad_accum_steps=accum,
                                             memory=mem, time=t, fits=mem.total_bytes <= usable))
    return out, skipped


__all__ = ["candidates", "check_overrides", "check_tp", "tp_degrees", "TP_KINDS",
           "profile_for_goal", "STRATEGY_ORDER",
           "DEFAULT_MAX_MICRO_BATCH", "OVERRIDE_KEYS"]

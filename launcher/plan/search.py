"""The planner: enumerate candidate strategies, drop what does not fit, rank by predicted speed.

Pure functions of the frozen specs (no torch, no I/O). The search space:
strategy {ddp, fsdp_grad_op, fsdp_full, hybrid (multi-node only)} x precision (bf16 where the
device has it, else fp16 + GradScaler on CUDA; fp32 and, where the CPU lists a bf16 peak, bf16 on
CPU) x activation checkpointing {none, selective, every-other, full} x micro-batch (powers of two); torch.compile where
`compile_choice` proposes it (GPUs, a Dynamo trace without graph breaks, a gain worth the compile
time), priced by the same cost model and explained in the reasons. Nothing here encodes the
seed rule ("DDP when it fits, FSDP when it does not, DDP/hybrid on slow links"): it comes out of
`memory.estimate_memory` and `cost.step_time`.

Pure: never imports torch, does no I/O, and never imports cli, backends, jobs, runtime, results
or report.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

from launcher.alloc_conf import alloc_conf_env, installed_torch_version
from launcher.errors import PlanError
from launcher.hardware.types import Topology
from launcher.plan.candidates import (
    DEFAULT_MAX_MICRO_BATCH,
    OVERRIDE_KEYS,
    STRATEGY_ORDER,
    candidates,
    check_overrides,
    check_tp,
    profile_for_goal,
)
from launcher.plan.checkpointing import LABELS as CKPT_LABELS
from launcher.plan.checkpointing import describe
from launcher.plan.compile_choice import decide
from launcher.plan.compile_probe import CompileCheck
from launcher.plan.interval import step_interval
from launcher.plan.memory import fmt_gib, usable_mem_bytes
from launcher.plan.step_probe import WorkloadTiming
from launcher.plan.types import Candidate, CompileDecision, Plan
from launcher.specs import CHECKPOINTING, Goal, ModelProfile

logger = logging.getLogger(__name__)

LABELS = {"ddp": "DDP", "fsdp_grad_op": "FSDP grad-op", "fsdp_full": "FSDP full",
          "hybrid": "hybrid"}
# Predictions closer than this are a tie: the model is not more accurate than a few percent.
TIE_TOLERANCE = 0.02


def _matches(c: Candidate, ov: Mapping[str, Any]) -> bool:
    s = c.strategy
    return (ov.get("strategy", s.kind) == s.kind
            and ov.get("checkpointing", s.checkpointing) == s.checkpointing)


def dp_ranks(c: Candidate, n: int) -> int:
    """Ranks that take their own samples: all `n`, or n / tp under tensor parallelism."""
    return n // c.strategy.tp


def _per_sample(c: Candidate) -> float:
    # per sample of the whole job: a TP candidate's tp ranks share each sample
    return c.time.step_time_s * c.strategy.tp / (c.micro_batch * c.grad_accum_steps)


def _preference(c: Candidate) -> tuple[int, int, int, int, float]:
    """Among near-ties: STRATEGY_ORDER, the smaller TP degree (fewer moving parts, more data
    parallelism), the lighter checkpointing (none, selective, every-other, full: the order of
    CHECKPOINTING), then the larger micro-batch (the model does not see the better kernel
    efficiency of larger batches), then speed."""
    s = c.strategy
    return (STRATEGY_ORDER.index(s.kind), s.tp, CHECKPOINTING.index(s.checkpointing),
            -c.micro_batch, _per_sample(c))


def _choose(fitting: list[Candidate]) -> Candidate:
    """Fastest per sample; among those within TIE_TOLERANCE of it, the preferred one."""
    best = min(_per_sample(c) for c in fitting)
    near = [c for c in fitting if _per_sample(c) <= best * (1 + TIE_TOLERANCE)]
    return min(near, key=_preference)


def kind_label(c: Candidate) -> str:
    """The strategy with its TP degree: `FSDP full`, `FSDP full+tp8`."""
    s = c.strategy
    return LABELS[s.kind] + (f"+tp{s.tp}" if s.tp > 1 else "")


def label(c: Candidate) -> str:
    """Short human name: `FSDP full bf16 + ckpt` (every block checkpointed; `+ sel-ckpt`
    selective, `+ ckpt/2` every other block), `FSDP full+tp8 bf16`."""
    s = c.strategy
    return f"{kind_label(c)} {s.precision}" + (f" + {CKPT_LABELS[s.checkpointing]}"
                                               if s.recomputes else "")


def _units_per_s(c: Candidate, n: int, profile: ModelProfile) -> float:
    return (c.micro_batch * c.grad_accum_steps * dp_ranks(c, n) * profile.units_per_sample
            / c.time.step_time_s)


def _speed(c: Candidate, goal: Goal, n: int, profile: ModelProfile) -> str:
    """Step time when the global batch is fixed (comparable), else throughput."""
    if goal.global_batch is not None:
        return f"{c.time.step_time_s:.3g} s/step"
    return f"{_units_per_s(c, n, profile):,.0f} {profile.sample_units}/s"


def per_device(topology: Topology) -> str:
    return "GPU" if topology.device == "cuda" else "rank"


def _too_big(c: Candidate, usable: float, profile: ModelProfile, topology: Topology) -> str:
    """'131.2 GiB/GPU > 71.6 GiB usable at micro-batch 1 (params+grads+optimizer ...)'."""
    m = c.memory
    state = m.params_bytes + m.grads_bytes + m.optimizer_bytes
    units = "" if c.strategy.kind == "ddp" else " incl. unsharded params"
    return (f"{fmt_gib(m.total_bytes)} GiB/{per_device(topology)} > {fmt_gib(usable)} GiB "
            f"usable at micro-batch {c.micro_batch} (params+grads+optimizer {fmt_gib(state)} GiB "
            f"= {state / profile.num_params:.3g} B/param, activations "
            f"{fmt_gib(m.activations_bytes)}, overhead{units} {fmt_gib(m.overhead_bytes)})")


def _env(topology: Topology) -> dict[str, str]:
    env: dict[str, str] = {}
    if topology.device == "cpu":
        # torchrun only sets OMP_NUM_THREADS=1 when nproc > 1; oversubscribed cores run 4x slower
        env["OMP_NUM_THREADS"] = str(topology.rank_threads)
        return env
    # fewer fragmentation OOMs with changing shapes; the memory model assumes it. Named as the
    # installed torch reads it (its version from the package metadata, read once: no torch)
    env.update(alloc_conf_env({}, installed_torch_version()))
    if topology.intra_node.kind == "pcie-nop2p":
        # GeForce cards report P2P NCCL cannot use; without this NCCL can hang or corrupt data
        env["NCCL_P2P_DISABLE"] = "1"
    if topology.num_nodes > 1 and topology.inter_node and topology.inter_node.kind == "ethernet":
        # NCCL's TCP transport needs several sockets/threads to fill a fast NIC (NCCL env docs)
        env["NCCL_SOCKET_NTHREADS"] = "4"
        env["NCCL_NSOCKS_PERTHREAD"] = "4"
    return env


def _reasons(chosen: Candidate, cands: list[Candidate], profile: ModelProfile,
             topology: Topology, goal: Goal, usable: float, skipped: list[int],
             compiled: CompileDecision) -> list[str]:
    """Human sentences: why this strategy, what the others would do, precision, checkpointing,
    compile (`compiled`: the decision, and what its predicted gain rests on). `cands` are the
    candidates the overrides allow; the first sentence only when chosen fits."""
    n, dev = topology.world_size, topology.accelerator
    fitting = [c for c in cands if c.fits] or [chosen]
    speed = lambda c: _speed(c, goal, n, profile)  # noqa: E731
    mem = f"{fmt_gib(chosen.memory.total_bytes)} GiB of {fmt_gib(usable)} usable"
    # the best fitting candidate of each strategy and TP degree
    keyed = lambda c: (c.strategy.kind, c.strategy.tp)  # noqa: E731
    order = sorted({keyed(c) for c in cands} | {keyed(chosen)},
                   key=lambda k: (STRATEGY_ORDER.index(k[0]), k[1]))
    best_by_kind = {}
    for key in order:
        fit = [c for c in fitting if keyed(c) == key]
        if fit:
            best_by_kind[key] = _choose(fit)
    others = [c for k, c in best_by_kind.items() if k != keyed(chosen)]
    name = kind_label(chosen)
    if n == 1:
        head = f"one device: a plain process, nothing to shard ({mem}): {speed(chosen)}"
    elif not others:
        head = f"{name} fits ({mem}) and is the only strategy that fits: {speed(chosen)}"
    else:
        runner = min(others, key=_per_sample)
        rname = kind_label(runner)
        if _per_sample(runner) < _per_sample(chosen) * (1 + TIE_TOLERANCE):
            head = (f"{name} fits ({mem}) and ties with {rname}: {speed(chosen)} vs "
                    f"{speed(runner)} (within {TIE_TOLERANCE:.0%}; ties go to DDP, then to "
                    f"the strategy that keeps less in memory, then to less TP)")
        else:
            head = (f"{name} fits ({mem}) and is fastest: {speed(chosen)} vs {rname} "
                    f"{speed(runner)}")
    out = [head] if chosen.fits else []
    out += _tp_reasons(chosen, cands, best_by_kind, topology, goal, profile, usable)
    for key in order:
        if key == keyed(chosen):
            continue
        mine = [c for c in cands if keyed(c) == key]
        if key in best_by_kind:
            c = best_by_kind[key]
            out.append(f"{kind_label(c)}: {speed(c)} (micro-batch {c.micro_batch} x "
                       f"{c.grad_accum_steps} accumulation"
                       + (f", checkpointing {c.strategy.checkpointing}"
                          if c.strategy.recomputes else "") + ")")
        elif mine:
            smallest = min(mine, key=lambda c: c.memory.total_bytes)
            out.append(f"{kind_label(smallest)} does not fit: "
                       + _too_big(smallest, usable, profile, topology))
    prec = chosen.strategy.precision
    if topology.device == "cuda":
        cc = ".".join(map(str, dev.compute_capability or ()))
        out.append(f"bf16 mixed precision: {dev.name} supports bf16 (compute capability {cc})"
                   if prec == "bf16" else
                   f"fp16 with GradScaler: {dev.name} (compute capability {cc}) has no bf16"
                   if prec == "fp16" else "fp32: no mixed precision")
    elif prec == "bf16":
        out.append("bf16 autocast on CPU: this CPU lists a bf16 peak and bf16 is predicted faster")
    else:
        out.append(f"{prec} on CPU" + ("" if "bf16" in dev.peak_tflops
                                       else " (this CPU lists no bf16 peak)"))
    if chosen.strategy.recomputes and chosen.fits:
        out.append(_checkpointing_reason(chosen, cands, fitting, usable))
    if prec == "bf16" and not dev.supports_bf16:
        out.append(f"warning: {dev.name} has no bf16 units: bf16 autocast will fail or run "
                   f"emulated and slow; use fp16 (with GradScaler) or fp32")
    if prec == "fp16" and topology.device == "cpu":
        out.append("warning: fp16 autocast on CPU is slow and needs a GradScaler; "
                   "use bf16 or fp32")
    out += [compiled.reason, *([compiled.basis] if compiled.basis else [])]
    t = chosen.time
    out.append(f"communication: {t.comm_total_s:.3g} s per step, {t.comm_exposed_s:.3g} s of it "
               f"exposed ({t.comm_exposed_s / t.step_time_s:.0%} of the step)")
    dp = dp_ranks(chosen, n)
    if goal.global_batch is None:
        out.append(f"no global batch given: micro-batch {chosen.micro_batch} (the power of two up "
                   f"to {DEFAULT_MAX_MICRO_BATCH[topology.device]} with the best throughput that fits) x {dp} "
                   f"{'data-parallel ' if dp != n else ''}ranks, no accumulation")
    if skipped:
        out.append(f"micro-batches {', '.join(map(str, skipped))} skipped: "
                   f"{goal.global_batch} samples over {dp} ranks do not split into them evenly")
    return out


def _checkpointing_reason(chosen: Candidate, cands: list[Candidate], fitting: list[Candidate],
                          usable: float) -> str:
    """Why the chosen checkpointing mode: what it recomputes (the extra compute against the
    same candidate without checkpointing), and that no lighter mode does better: a lighter one
    either does not fit at the chosen micro-batch or is slower per sample."""
    s = chosen.strategy
    if {c.strategy.checkpointing for c in cands} == {s.checkpointing}:
        return f"activation checkpointing, {describe(s.checkpointing)}: as forced"
    same = [c for c in cands if (c.strategy.kind, c.strategy.tp, c.strategy.precision,
                                 c.micro_batch) == (s.kind, s.tp, s.precision, chosen.micro_batch)]
    base = next((c for c in same if not c.strategy.recomputes), None)
    extra = (f", {chosen.time.compute_s / base.time.compute_s - 1:.0%} more compute than without"
             if base is not None and base.time.compute_s > 0 else "")
    plain = [c for c in fitting if c.strategy.kind == s.kind and not c.strategy.recomputes]
    why = [f"activation checkpointing, {describe(s.checkpointing)}{extra}: "
           + ("it allows a larger micro-batch and is faster despite the recompute" if plain
              else f"without it {kind_label(chosen)} does not fit")]
    for c in same:
        if CHECKPOINTING.index(c.strategy.checkpointing) >= CHECKPOINTING.index(s.checkpointing) \
                or not c.strategy.recomputes:
            continue
        why.append(f"{c.strategy.checkpointing} " + (
            f"needs {fmt_gib(c.memory.total_bytes)} GiB > {fmt_gib(usable)} usable" if not c.fits
            else f"is slower per sample at micro-batch {c.micro_batch}"))
    return "; ".join(why)


def _tp_reasons(chosen: Candidate, cands: list[Candidate],
                best: Mapping[tuple[str, int], Candidate], topology: Topology, goal: Goal,
                profile: ModelProfile, usable: float) -> list[str]:
    """Why the plan uses tensor parallelism, or why not (where TP candidates were priced)."""
    n, t = topology.world_size, chosen.strategy.tp
    tried = sorted({c.strategy.tp for c in cands if c.strategy.tp > 1})
    if t > 1:
        plain = [c for k, c in best.items() if k[1] == 1]
        smallest = min((c for c in cands if c.strategy.tp == 1),
                       key=lambda c: c.memory.total_bytes, default=None)
        tp_s = chosen.time.comm_total_s  # TP's share is in the total; say the step's layout
        why = (f"TP {t}: tensor parallelism inside each node splits every block's matmuls "
               f"{t} ways (DP {n // t} x TP {t}; a sample is shared by {t} GPUs)")
        if not plain and smallest is not None:
            why += (f"; without TP nothing fits at micro-batch {smallest.micro_batch}: "
                    f"{_too_big(smallest, usable, profile, topology)}")
        elif plain:
            rival = min(plain, key=_per_sample)
            why += (f"; {_gain(rival, chosen)} than the best without TP, {kind_label(rival)} "
                    f"at micro-batch {rival.micro_batch}")
        exposed = chosen.time.comm_exposed_s
        return [why + f"; its activation all-gathers/reduce-scatters over "
                f"{topology.intra_node.kind} are exposed (no async TP): {exposed:.3g} s of "
                f"{chosen.time.step_time_s:.3g} s exposed communication per step "
                f"(of {tp_s:.3g} s in all)"]
    out = []
    for d in tried:
        fit = [c for k, c in best.items() if k[1] == d]
        if fit:
            c = fit[0] if len(fit) == 1 else min(fit, key=_per_sample)
            if chosen.fits:
                out.append(f"TP {d} ({kind_label(c)}) predicted {_gain(c, chosen)} than "
                           f"the chosen plan: its activation all-gathers and reduce-scatters "
                           f"over {topology.intra_node.kind} are exposed (no async TP) and "
                           f"its matmuls {d}x narrower")
        else:
            out.append(f"TP {d} does not fit either")
    return out


def _gain(c: Candidate, ref: Candidate) -> str:
    """'12% faster' / '8% slower': `c` per sample against `ref`."""
    r = _per_sample(ref) / _per_sample(c) - 1
    return f"{abs(r):.0%} {'faster' if r >= 0 else 'slower'}"


def _rejected(chosen: Candidate, cands: list[Candidate], goal: Goal, topology: Topology,
              profile: ModelProfile, usable: float) -> list[Candidate]:
    """Best candidate of each (strategy, precision, checkpointing) group but the chosen one's,
    each with the reason it lost: slower, a tie the preferred plan won, or too big."""
    n = topology.world_size
    key = lambda c: (c.strategy.kind, c.strategy.tp, c.strategy.precision,  # noqa: E731
                     c.strategy.checkpointing)
    groups: dict[tuple[str, int, str, str], list[Candidate]] = {}
    for c in cands:
        groups.setdefault(key(c), []).append(c)
    groups.pop(key(chosen), None)
    mine = _speed(chosen, goal, n, profile)
    out = []
    for members in groups.values():
        fit = [c for c in members if c.fits]
        if fit:
            best = _choose(fit)
            theirs = _speed(best, goal, n, profile)
            tie = _per_sample(best) <= _per_sample(chosen) * (1 + TIE_TOLERANCE)
            # faster beyond a tie: only an override (a forced strategy, mode, ...) passes it over
            faster = _per_sample(best) * (1 + TIE_TOLERANCE) < _per_sample(chosen)
            why = (f"{label(best)}: fits and is faster ({theirs} vs {mine}) but the overrides "
                   f"rule it out" if faster else
                   f"{label(best)}: ties with the chosen plan ({theirs} vs {mine}, within "
                   f"{TIE_TOLERANCE:.0%}), which is preferred on ties" if tie and chosen.fits else
                   f"{label(best)}: fits ({fmt_gib(best.memory.total_bytes)} GiB) but slower: "
                   f"{theirs} vs {mine}")
        else:
            best = min(members, key=lambda c: c.memory.total_bytes)
            why = f"{label(best)}: {_too_big(best, usable, profile, topology)}"
        out.append(dataclasses.replace(best, reason=why))
    return sorted(out, key=lambda c: (not c.fits,
                                      _per_sample(c) if c.fits else c.memory.total_bytes))


def plan(profile: ModelProfile, topology: Topology, goal: Goal, *,
         overrides: Mapping[str, Any] | None = None, timing: WorkloadTiming | None = None,
         compile_check: CompileCheck | None = None,
         compute_factor: Callable[[str], float] | None = None, correction_note: str = "") -> Plan:
    """Recommend a strategy for training `profile` on `topology` towards `goal`, with reasons.

    `overrides` (keys in OVERRIDE_KEYS; None values are ignored) force those fields; a forced
    plan that does not fit is still returned, with a first reason starting "warning:".
    `timing`: the workload's own steps timed on this (CPU) host, the compute of every candidate
    when they ran at the goal's sequence length. `compile_check`: Dynamo's trace of the
    workload; without it (or a `compile` override) a GPU plan does not propose torch.compile
    (`compile_choice`). `compute_factor`: this machine's tune corrections, precision -> factor
    on every candidate's predicted compute, applied before the choice so that the choice, its
    reasons and every number shown come from one corrected estimate (`correction_note` says so
    among the reasons). Raises PlanError when nothing fits, or when an override is impossible.
    """
    ov = check_overrides(overrides, topology)
    check_tp(ov, profile, topology)
    profile = profile_for_goal(profile, goal)
    if timing is not None and timing.units_per_sample != profile.units_per_sample:
        timing = None  # timed at another sequence length: the rates' model applies
    n = topology.world_size
    usable = usable_mem_bytes(topology.accelerator, goal.headroom)
    cands, skipped = candidates(profile, topology, goal, ov, usable, timing, compile_check)
    if compute_factor is not None:
        cands = [c.with_compute_scaled(compute_factor(c.strategy.precision)) for c in cands]
    allowed = [c for c in cands if _matches(c, ov)]
    fitting = [c for c in allowed if c.fits]
    warnings = []
    if fitting:
        chosen = _choose(fitting)
    elif ov:
        chosen = min(allowed, key=lambda c: c.memory.total_bytes)
        alt = [c for c in cands if c.fits]
        warnings.append(f"warning: the forced plan does not fit: {label(chosen)}: "
                        f"{_too_big(chosen, usable, profile, topology)}; it will run out of "
                        f"memory" + (f" ({label(_choose(alt))} would fit)" if alt else ""))
    else:
        smallest = min(cands, key=lambda c: c.memory.total_bytes)
        fixes = ["add GPUs or nodes (FSDP shards the model state over them)"]
        if not smallest.strategy.recomputes:
            fixes.append("enable activation checkpointing")
        fixes.append("shorten the sequence" if profile.sample_units == "tokens"
                     else "use a smaller model")
        raise PlanError(
            f"nothing fits on {n} x {topology.accelerator.name} ({fmt_gib(usable)} GiB usable "
            f"each): the smallest candidate, {label(smallest)} at micro-batch "
            f"{smallest.micro_batch}, needs {fmt_gib(smallest.memory.total_bytes)} GiB per "
            f"{per_device(topology)}; "
            f"{', '.join(fixes[:-1])} or {fixes[-1]}")
    compiled = decide(chosen, profile, topology, ov, compile_check, timing=timing,
                      recompute_fraction=ov.get("recompute_fraction"),
                      compute_factor=1.0 if compute_factor is None
                      else compute_factor(chosen.strategy.precision))
    reasons = warnings + _reasons(chosen, allowed, profile, topology, goal, usable, skipped,
                                  compiled)
    if correction_note:
        reasons.insert(1, correction_note)
    if timing is not None:
        reasons.append(f"step time: {timing.describe()}, plus the model's FSDP work and gloo "
                       "collectives")
    if ov:
        forced = ", ".join(f"{k}={v}" for k, v in sorted(ov.items()))
        reasons.append(f"forced by overrides: {forced}")
    chosen = dataclasses.replace(chosen, reason=reasons[0])
    # with TP, tp ranks share each sample: samples per step = mb x accum x world / tp
    global_batch = chosen.micro_batch * chosen.grad_accum_steps * dp_ranks(chosen, n)
    t = chosen.time
    result = Plan(chosen=chosen, world_size=n, num_nodes=topology.num_nodes,
                  global_batch=global_batch, units_per_s=_units_per_s(chosen, n, profile),
                  # weak scaling vs one device doing the same per-rank work with no communication
                  scaling_efficiency=t.compute_s / t.step_time_s if t.step_time_s else 1.0,
                  env=_env(topology), reasons=tuple(reasons),
                  rejected=tuple(_rejected(chosen, cands, goal, topology, profile, usable)),
                  usable_mem_bytes=usable, compile=compiled,
                  step_interval=step_interval(
                      t.step_time_s, on_gpu=topology.device == "cuda", world_size=n,
                      seq_len=profile.units_per_sample if profile.sample_units == "tokens" else None))
    logger.debug("plan %s on %s: %s (%d candidates)", profile.name, topology.name,
                 label(chosen), len(cands))
    return result


__all__ = ["plan", "profile_for_goal", "label", "kind_label", "dp_ranks", "LABELS", "per_device", "STRATEGY_ORDER",
           "TIE_TOLERANCE", "DEFAULT_MAX_MICRO_BATCH", "OVERRIDE_KEYS"]

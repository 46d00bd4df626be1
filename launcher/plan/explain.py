"""Why the plan is what it is: the sentences of `Plan.reasons` (why this strategy, what each
other would do or why it does not fit, precision, tensor parallelism, checkpointing, compile,
communication, the batch), each rejected candidate with the reason it lost (`Plan.rejected`), and
the short names candidates go by (`label`). `search` chooses; this only explains.

Pure: never imports torch, does no I/O, and never imports cli, backends, jobs, runtime, results
or report.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from launcher.hardware.types import Topology
from launcher.plan.candidates import (
    DEFAULT_MAX_MICRO_BATCH,
    STRATEGY_ORDER,
    TIE_TOLERANCE,
    choose,
    dp_ranks,
    per_sample,
    units_per_s,
)
from launcher.plan.checkpointing import LABELS as CKPT_LABELS
from launcher.plan.checkpointing import describe
from launcher.plan.float8 import converted_share, gemm_speedup
from launcher.plan.float8 import supported as float8_supported
from launcher.plan.memory import fmt_gib, usable_mem_bytes
from launcher.plan.types import Candidate, CompileDecision
from launcher.specs import CHECKPOINTING, GIB, Goal, ModelProfile, Strategy

LABELS = {"ddp": "DDP", "zero1": "ZeRO-1", "fsdp_grad_op": "FSDP grad-op", "fsdp_full": "FSDP full", "hybrid": "hybrid"}


def kind_label(c: Candidate) -> str:
    """The strategy with its TP degree: `FSDP full`, `FSDP full+tp8`."""
    s = c.strategy
    return LABELS[s.kind] + (f"+tp{s.tp}" if s.tp > 1 else "")


def label(c: Candidate) -> str:
    """Short human name: `FSDP full bf16 + ckpt` (every block checkpointed; `+ sel-ckpt`
    selective, `+ ckpt/2` every other block), `FSDP full+tp8 bf16`."""
    s = c.strategy
    prec = f"float8 ({s.float8})" if s.float8 != "none" else s.precision
    return (f"{kind_label(c)} {prec}" + (f" + {CKPT_LABELS[s.checkpointing]}" if s.recomputes else "")
            + (" + offload" if s.offload else "") + (" + linear units" if s.fsdp_unit == "linear" else ""))


def _speed(c: Candidate, goal: Goal, n: int, profile: ModelProfile) -> str:
    """Step time when the global batch is fixed (comparable), else throughput."""
    if goal.global_batch is not None:
        return f"{c.time.step_time_s:.3g} s/step"
    return f"{units_per_s(c, n, profile):,.0f} {profile.sample_units}/s"


def per_device(topology: Topology) -> str:
    return "GPU" if topology.device == "cuda" else "rank"


def within_card(c: Candidate, topology: Topology) -> bool:
    """Whether `c`, whatever the headroom, fits the device's memory (and, offloaded, the host's:
    the planner's `fits` already says so there)."""
    return c.fits or (not c.strategy.offload and c.memory.total_bytes <= usable_mem_bytes(topology.accelerator, 0.0))


def too_big(c: Candidate, usable: float, profile: ModelProfile, topology: Topology) -> str:
    """'131.2 GiB/GPU > 71.6 GiB usable at micro-batch 1 (params+grads+optimizer ...)'."""
    m = c.memory
    state = m.params_bytes + m.grads_bytes + m.optimizer_bytes
    units = "" if not c.strategy.shards_params else " incl. unsharded params"
    return (f"{fmt_gib(m.total_bytes)} GiB/{per_device(topology)} > {fmt_gib(usable)} GiB usable at micro-batch "
            f"{c.micro_batch} (params+grads+optimizer {fmt_gib(state)} GiB = {state / profile.num_params:.3g} B/param, "
            f"activations {fmt_gib(m.activations_bytes)}, overhead{units} {fmt_gib(m.overhead_bytes)})")


def reasons(chosen: Candidate, cands: list[Candidate], profile: ModelProfile, topology: Topology, goal: Goal,
            usable: float, skipped: list[int], compiled: CompileDecision) -> list[str]:
    """Human sentences: why this strategy, what the others would do, precision, checkpointing,
    compile (`compiled`: the decision, and what its predicted gain rests on). `cands` are the
    candidates the overrides allow; the first sentence only when chosen fits."""
    n, dev = topology.world_size, topology.accelerator
    fitting = [c for c in cands if c.fits] or [chosen]
    speed = lambda c: _speed(c, goal, n, profile)  # noqa: E731
    mem = f"{fmt_gib(chosen.memory.total_bytes)} GiB of {fmt_gib(usable)} usable"
    # the best fitting candidate of each strategy and TP degree
    keyed = lambda c: (c.strategy.kind, c.strategy.tp)  # noqa: E731
    order = sorted({keyed(c) for c in cands} | {keyed(chosen)}, key=lambda k: (STRATEGY_ORDER.index(k[0]), k[1]))
    best_by_kind = {key: choose(fit) for key in order if (fit := [c for c in fitting if keyed(c) == key])}
    others = [c for k, c in best_by_kind.items() if k != keyed(chosen)]
    name = kind_label(chosen)
    if n == 1 and not chosen.strategy.offload:
        head = f"one device: a plain process, nothing to shard ({mem}): {speed(chosen)}"
    elif not others:
        head = f"{name} fits ({mem}) and is the only strategy that fits: {speed(chosen)}"
    else:
        runner = min(others, key=per_sample)
        rname = kind_label(runner)
        if per_sample(runner) < per_sample(chosen) * (1 + TIE_TOLERANCE):
            head = (f"{name} fits ({mem}) and ties with {rname}: {speed(chosen)} vs "
                    f"{speed(runner)} (within {TIE_TOLERANCE:.0%}; ties go to DDP, then to "
                    f"the strategy that keeps less in memory, then to less TP)")
        else:
            head = f"{name} fits ({mem}) and is fastest: {speed(chosen)} vs {rname} {speed(runner)}"
    out = [head] if chosen.fits else []
    out += _tp_reasons(chosen, cands, best_by_kind, topology, profile, usable)
    for key in order:
        if key == keyed(chosen):
            continue
        mine = [c for c in cands if keyed(c) == key]
        if key in best_by_kind:
            c = best_by_kind[key]
            out.append(f"{kind_label(c)}: {speed(c)} (micro-batch {c.micro_batch} x {c.grad_accum} accumulation"
                       + (f", checkpointing {c.strategy.checkpointing}" if c.strategy.recomputes else "") + ")")
        elif mine:
            smallest = min(mine, key=lambda c: c.memory.total_bytes)
            out.append(f"{kind_label(smallest)} does not fit: " + too_big(smallest, usable, profile, topology))
    prec = chosen.strategy.precision
    if topology.device == "cuda":
        cc = ".".join(map(str, dev.compute_capability or ()))
        out.append(f"bf16 mixed precision: {dev.name} supports bf16 (compute capability {cc})"
                   if prec == "bf16" else
                   f"fp16 with GradScaler: {dev.name} (compute capability {cc}) has no bf16"
                   if prec == "fp16" else "fp32: no mixed precision")
    elif prec == "bf16" and chosen.strategy.reduce_dtype == "bf16":
        out.append("bf16 autocast on CPU: the bf16 gradient reduce (--reduce-dtype bf16) needs it")
    elif prec == "bf16":
        out.append("bf16 autocast on CPU: this CPU lists a bf16 peak and bf16 is predicted faster")
    else:
        out.append(f"{prec} on CPU" + ("" if "bf16" in dev.peak_tflops else " (this CPU lists no bf16 peak)"))
    out += _float8_reason(chosen, cands, profile, topology)
    if chosen.strategy.recomputes and chosen.fits:
        out.append(_checkpointing_reason(chosen, cands, fitting, usable))
    if prec == "bf16" and not dev.supports_bf16:
        out.append(f"warning: {dev.name} has no bf16 units: bf16 autocast will fail or run "
                   f"emulated and slow; use fp16 (with GradScaler) or fp32")
    if prec == "fp16" and topology.device == "cpu":
        out.append("warning: fp16 autocast on CPU is slow and needs a GradScaler; use bf16 or fp32")
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


def _float8_reason(chosen: Candidate, cands: list[Candidate], profile: ModelProfile, topology: Topology) -> list[str]:
    """Float8 against bf16 for the chosen plan's shape (the same strategy, checkpointing and
    batch): what it converts and its predicted gain, or why the plan does not use it."""
    dev, s = topology.accelerator, chosen.strategy
    if topology.device != "cuda" or s.precision != "bf16":
        return []
    if not float8_supported(dev):
        return [f"float8: not weighed: {dev.name} has no float8 tensor cores (compute capability "
                f"{'.'.join(map(str, dev.compute_capability or ()))} < 8.9)"]
    twin = next((c for c in cands if c.strategy == dataclasses.replace(
        s, float8="none" if s.float8 != "none" else "tensorwise")
        and (c.micro_batch, c.grad_accum) == (chosen.micro_batch, chosen.grad_accum)), None)
    f8, bf16 = (chosen, twin) if s.float8 != "none" else (twin, chosen)
    if f8 is None or bf16 is None:
        return [f"float8 ({s.float8}): as given" if s.float8 != "none" else "float8: as given (none)"]
    share = converted_share(profile, f8.strategy.float8, s.tp)
    gain = bf16.time.step_time_s / f8.time.step_time_s - 1
    what = (f"torchao's Float8Linear on the blocks' linears that pass its {f8.strategy.float8} filter ({share:.0%} of "
            f"their matmul FLOPs; the output head, attention and the memory-bound work stay bf16), its GEMMs at "
            f"{gemm_speedup():g}x bf16's rate, its casts as HBM traffic")
    if s.float8 != "none":
        return [f"float8 ({s.float8}): {bf16.time.step_time_s:.3g} -> {f8.time.step_time_s:.3g} "
                f"s/step predicted ({gain:+.0%} throughput): {what}; needs torchao "
                "(pip install 'dlaunch[float8]'), --float8 none keeps bf16"]
    # faster and not chosen: too big, or within a tie (ties go to bf16)
    lost = "" if gain <= 0 else ", but it does not fit" if not f8.fits else ", a tie: bf16 kept"
    return [f"float8: weighed, not used: {f8.time.step_time_s:.3g} s/step against "
            f"{bf16.time.step_time_s:.3g} in bf16 ({gain:+.0%} throughput{lost}): "
            + ("no linear passes torchao's filter at this width" if not share else what)]


def _but_checkpointing(a: Strategy, b: Strategy) -> bool:
    """Whether `a` is `b` in another checkpointing mode, field by field: `a` in `b`'s mode need not be a
    strategy at all (linear FSDP units take no selective checkpointing)."""
    return {**dataclasses.asdict(a), "checkpointing": b.checkpointing} == dataclasses.asdict(b)


def _checkpointing_reason(chosen: Candidate, cands: list[Candidate], fitting: list[Candidate], usable: float) -> str:
    """Why the chosen checkpointing mode: what it recomputes (the extra compute against the
    same candidate without checkpointing), and that no lighter mode does better: a lighter one
    either does not fit at the chosen micro-batch or is slower per sample."""
    s = chosen.strategy
    if {c.strategy.checkpointing for c in cands} == {s.checkpointing}:
        return f"activation checkpointing, {describe(s.checkpointing)}: as forced"
    # the chosen plan in every other mode: the same strategy (offload, unit, compile ...) and micro-batch
    same = [c for c in cands if c.micro_batch == chosen.micro_batch and _but_checkpointing(c.strategy, s)]
    base = next((c for c in same if not c.strategy.recomputes), None)
    extra = (f", {chosen.time.compute_s / base.time.compute_s - 1:.0%} more compute than without"
             if base is not None and base.time.compute_s > 0 else "")
    # the chosen strategy without checkpointing
    plain = [c for c in fitting if not c.strategy.recomputes and _but_checkpointing(c.strategy, s)]
    why = [f"activation checkpointing, {describe(s.checkpointing)}{extra}: "
           + ("it allows a larger micro-batch and is faster despite the recompute" if plain
              else f"without it {kind_label(chosen)} does not fit")]
    rank = CHECKPOINTING.index
    for c in same:  # the lighter modes
        if c.strategy.recomputes and rank(c.strategy.checkpointing) < rank(s.checkpointing):
            why.append(f"{c.strategy.checkpointing} " + (
                f"needs {fmt_gib(c.memory.total_bytes)} GiB > {fmt_gib(usable)} usable" if not c.fits
                else f"is slower per sample at micro-batch {c.micro_batch}"))
    return "; ".join(why)


def _tp_reasons(chosen: Candidate, cands: list[Candidate], best: Mapping[tuple[str, int], Candidate],
                topology: Topology, profile: ModelProfile, usable: float) -> list[str]:
    """Why the plan uses tensor parallelism, or why not (where TP candidates were priced)."""
    n, t = topology.world_size, chosen.strategy.tp
    tried = sorted({c.strategy.tp for c in cands if c.strategy.tp > 1})
    if t > 1:
        plain = [c for k, c in best.items() if k[1] == 1]
        smallest = min((c for c in cands if c.strategy.tp == 1), key=lambda c: c.memory.total_bytes, default=None)
        tp_s = chosen.time.comm_total_s  # TP's share is in the total; say the step's layout
        why = (f"TP {t}: tensor parallelism inside each node splits every block's matmuls "
               f"{t} ways (DP {n // t} x TP {t}; a sample is shared by {t} GPUs)")
        if not plain and smallest is not None:
            why += (f"; without TP nothing fits at micro-batch {smallest.micro_batch}: "
                    f"{too_big(smallest, usable, profile, topology)}")
        elif plain:
            rival = min(plain, key=per_sample)
            why += (f"; {_gain(chosen, rival)} than the best without TP, {kind_label(rival)} "
                    f"at micro-batch {rival.micro_batch}")
        exposed = chosen.time.comm_exposed_s
        return [why + f"; its activation all-gathers/reduce-scatters over {topology.intra_node.kind} are exposed (no "
                      f"async TP): {exposed:.3g} s of {chosen.time.step_time_s:.3g} s exposed communication per step "
                      f"(of {tp_s:.3g} s in all)"]
    out = []
    for d in tried:
        fit = [c for k, c in best.items() if k[1] == d]
        if fit:
            c = min(fit, key=per_sample)
            if chosen.fits:
                out.append(f"TP {d} ({kind_label(c)}) predicted {_gain(c, chosen)} than the chosen plan: its "
                           f"activation all-gathers and reduce-scatters over {topology.intra_node.kind} are exposed "
                           f"(no async TP) and its matmuls {d}x narrower")
        else:
            out.append(f"TP {d} does not fit either")
    return out


def _gain(c: Candidate, ref: Candidate) -> str:
    """'12% faster' / '8% slower': `c` per sample against `ref`."""
    r = per_sample(ref) / per_sample(c) - 1
    return f"{abs(r):.0%} {'faster' if r >= 0 else 'slower'}"


def rejected(chosen: Candidate, cands: list[Candidate], goal: Goal, topology: Topology,
             profile: ModelProfile, usable: float) -> list[Candidate]:
    """Best candidate of each (strategy, precision, checkpointing) group but the chosen one's,
    each with the reason it lost: slower, a tie the preferred plan won, or too big."""
    n = topology.world_size
    key = lambda c: (c.strategy.kind, c.strategy.tp, c.strategy.precision,  # noqa: E731
                     c.strategy.float8, c.strategy.checkpointing, c.strategy.fsdp_unit)
    groups: dict[tuple[str, int, str, str, str, str], list[Candidate]] = {}
    for c in cands:
        groups.setdefault(key(c), []).append(c)
    groups.pop(key(chosen), None)
    mine = _speed(chosen, goal, n, profile)
    out = []
    for members in groups.values():
        fit = [c for c in members if c.fits]
        if fit:
            best = choose(fit)
            theirs = _speed(best, goal, n, profile)
            tie = per_sample(best) <= per_sample(chosen) * (1 + TIE_TOLERANCE)
            # faster beyond a tie: only an override (a forced strategy, mode, ...) passes it over
            faster = per_sample(best) * (1 + TIE_TOLERANCE) < per_sample(chosen)
            why = (f"{label(best)}: fits and is faster ({theirs} vs {mine}) but the overrides "
                   f"rule it out" if faster else
                   f"{label(best)}: ties with the chosen plan ({theirs} vs {mine}, within "
                   f"{TIE_TOLERANCE:.0%}), which is preferred on ties" if tie and chosen.fits else
                   f"{label(best)}: fits ({fmt_gib(best.memory.total_bytes)} GiB) but slower: {theirs} vs {mine}")
        else:
            best = min(members, key=lambda c: c.memory.total_bytes)
            why = f"{label(best)}: {too_big(best, usable, profile, topology)}"
        out.append(dataclasses.replace(best, reason=why))
    return sorted(out, key=lambda c: (not c.fits, per_sample(c) if c.fits else c.memory.total_bytes))


def host_too_small(c: Candidate, topology: Topology, headroom: float) -> str:
    """The one line for an offloaded plan whose state does not fit the node's host memory."""
    host = topology.host
    assert host is not None  # only offloaded candidates are priced, and only with a host
    need = c.memory.host_bytes * topology.devices_per_node
    return (f"nothing fits on {topology.world_size} x {topology.accelerator.name}, and CPU "
            f"offload ({label(c)} at micro-batch {c.micro_batch}) needs {fmt_gib(need)} GiB of "
            f"host memory per node for {topology.devices_per_node} rank(s) of "
            f"{fmt_gib(c.memory.host_bytes)} GiB: the node has {fmt_gib(host.mem_gib * GIB)} GiB "
            f"({1 - headroom:.0%} usable); use hosts with more memory, or add GPUs or nodes")

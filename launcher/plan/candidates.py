"""The planner's search space: candidate strategies, precisions, checkpointing and batches.

Pure functions of the frozen specs (no torch, no I/O); never imports cli, backends, jobs, runtime,
results or report. Each candidate gets its memory (`memory.estimate_memory`) and step time
(`cost.step_time`); `choose` ranks them (per sample, near-ties by STRATEGY_ORDER), `search`
picks among those the overrides allow and `explain` says why.
"""

from __future__ import annotations

import dataclasses

from launcher.errors import PlanError
from launcher.hardware.types import Topology
from launcher.plan.compile_choice import compiles, worth_compiling
from launcher.plan.compile_probe import CompileCheck
from launcher.plan.cost import attention_flops_fwd, shard_group_size, step_time
from launcher.plan.float8 import supported as float8_supported
from launcher.plan.memory import estimate_memory, optimizer_state_bytes
from launcher.plan.offload import NO_HOST, host_fits
from launcher.plan.step_probe import WorkloadTiming
from launcher.plan.types import Candidate, Overrides, StepTimeEstimate
from launcher.specs import CHECKPOINTING, DDP_KINDS, Goal, ModelProfile, Strategy, linear_units_ok
from launcher.workload import no_tp_plan

# Ties go to DDP (fewest moving parts), then to zero1 (DDP and a sharded optimizer, no hooks
# per unit), then to full shard over grad-op: at the same predicted speed full shard keeps less
# in memory (more headroom), and hybrid only wins when faster. zero1 is priced on one rank too
# (as DDP: nothing to shard over) but only proposed over several.
STRATEGY_ORDER = ("ddp", "zero1", "fsdp_full", "fsdp_grad_op", "hybrid")
# Predictions closer than this are a tie: the model is not more accurate than a few percent.
TIE_TOLERANCE = 0.02
# Without --global-batch: power-of-two micro-batches up to this, no accumulation; the best
# throughput wins, which (ties going to the larger micro-batch) is the largest that fits. Beyond 64
# the gains are small once compute dominates, and large batches need the learning rate retuned;
# users who want more pass --global-batch. On CPU a step's fixed cost (Python, the optimizer over
# every tensor) is amortized by 16 samples (the 0.9M-parameter MLP of workloads/mlp.py: 1.4x the
# samples/s at 16 as at 8, gpt tiny 1.03x); beyond, steps only get longer.
DEFAULT_MAX_MICRO_BATCH = {"cuda": 64, "cpu": 16}
# the strategies tensor parallelism composes with on a GPU plan's own initiative (the runtime
# builds a 2-D mesh ("dp", "tp") with FSDP on "dp"); a forced tp may also pair with grad-op
TP_KINDS = ("fsdp_full", "hybrid")


def profile_for_goal(profile: ModelProfile, goal: Goal) -> ModelProfile:
    """`profile` at `goal.seq_len`: activations, matmul FLOPs and backward's transient (the loss
    gradient over the vocabulary, a logits tensor per token) scale linearly with sequence length
    (exact for SDPA/flash attention, which saves no s x s scores), attention FLOPs and the s x s
    scores attention written out (or SDPA's math path) keeps quadratically. A profile that names
    no optimizer gets the goal's, assumed, so that memory and step time price the same one."""
    if not profile.optimizer:
        state, name = optimizer_state_bytes(profile, goal.optimizer)
        profile = dataclasses.replace(profile, optimizer=name, optimizer_state_bytes_per_param=state)
    if goal.seq_len is None or goal.seq_len == profile.units_per_sample:
        return profile
    if profile.sample_units != "tokens":
        raise PlanError(f"--seq-len {goal.seq_len} applies to sequence models (tokens per "
                        f"sample); {profile.name} counts {profile.sample_units}: drop --seq-len")
    r = goal.seq_len / profile.units_per_sample
    attention, scores = attention_flops_fwd(profile), profile.attention_scores_bytes_per_sample
    return dataclasses.replace(
        profile, units_per_sample=goal.seq_len,
        activation_bytes_per_sample=(profile.activation_bytes_per_sample - scores) * r + scores * r * r,
        attention_scores_bytes_per_sample=scores * r * r,
        attention_scores_upcast_bytes_per_sample=profile.attention_scores_upcast_bytes_per_sample * r * r,
        math_attention_bytes_per_sample=profile.math_attention_bytes_per_sample * r * r,
        block_input_bytes_per_sample=profile.block_input_bytes_per_sample * r,
        backward_transient_bytes_per_sample=profile.backward_transient_bytes_per_sample * r,
        flops_fwd_per_sample=(profile.flops_fwd_per_sample - attention) * r + attention * r * r,
        attention_flops_fwd_per_sample=attention * r * r,
        conv_flops_fwd_per_sample=profile.conv_flops_fwd_per_sample * r)


def check_forced(ov: Overrides, profile: ModelProfile, topology: Topology) -> None:
    """PlanError, in one line, for a forced strategy or tp > 1 the workload or the topology
    cannot take (what `Overrides` checks alone needs neither)."""
    if ov.offload and topology.device == "cuda" and topology.host is None:
        raise PlanError(NO_HOST.format(topology.name))
    if ov.reduce_dtype == "bf16" and topology.device == "cuda" and not topology.accelerator.supports_bf16:
        raise PlanError(f"--reduce-dtype bf16 reduces the gradients of a bf16 run, and {topology.accelerator.name} "
                        "has no bf16 units; drop --reduce-dtype or use --reduce-dtype fp32")
    if ov.float8 not in (None, "none") and topology.device == "cuda" and not float8_supported(topology.accelerator):
        cc = ".".join(map(str, topology.accelerator.compute_capability or ()))
        raise PlanError(f"--float8 {ov.float8} runs the linear layers' GEMMs on float8 tensor cores (compute "
                        f"capability 8.9 and later); {topology.accelerator.name} has none (compute capability "
                        f"{cc}): drop --float8 or use --float8 none")
    if ov.strategy == "hybrid" and topology.num_nodes <= 1:
        raise PlanError("strategy hybrid shards inside a node and replicates across nodes: it "
                        "needs more than one node; on one node use fsdp_full")
    tp = ov.tp or 1
    if tp <= 1:
        return
    if ov.strategy in DDP_KINDS:
        raise PlanError(f"--tp {tp} composes tensor parallelism with FSDP on the data-parallel dimension; "
                        f"{ov.strategy} does not: use --strategy fsdp_full or hybrid, or drop --tp")
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


def tp_degrees(kind: str, profile: ModelProfile, topology: Topology, ov: Overrides, unit: str = "block") -> list[int]:
    """The TP degrees to try with strategy `kind` and FSDP `unit`: the forced one; else on GPUs 1
    and, for TP_KINDS, each of the workload's degrees that divides the GPUs per node (tensor
    parallelism over NVLink only); CPU plans try TP only when forced; linear units run without it."""
    if ov.tp is not None:
        return [ov.tp] if ov.tp == 1 or kind not in DDP_KINDS else []
    if topology.device != "cuda" or kind not in TP_KINDS or unit == "linear":  # linear_units_ok
        return [1]
    return [1] + [d for d in profile.tp_degrees if d > 1 and topology.devices_per_node % d == 0]


def precisions_for(topology: Topology, ov: Overrides) -> list[str]:
    """The precisions the planner prices for `topology` under `ov` (what a CPU's step probe times)."""
    if ov.precision is not None:
        return [ov.precision]
    if ov.float8 not in (None, "none") or ov.reduce_dtype == "bf16":
        return ["bf16"]  # float8 runs everything but the converted GEMMs in bf16; a bf16 reduce needs bf16
    if topology.device == "cpu":
        return ["fp32", "bf16"] if "bf16" in topology.accelerator.peak_tflops else ["fp32"]
    return ["bf16"] if topology.accelerator.supports_bf16 else ["fp16"]


def _float8s(topology: Topology, ov: Overrides, precision: str) -> list[str]:
    """The float8 recipes to price with `precision`: the given one; else bf16 also as float8
    tensorwise (torchao's fastest recipe) on GPUs with float8 tensor cores."""
    if ov.float8 is not None:
        return [ov.float8]
    if precision == "bf16" and topology.device == "cuda" and float8_supported(topology.accelerator):
        return ["none", "tensorwise"]
    return ["none"]


def _batches(goal: Goal, n: int, ov: Overrides, device: str) -> tuple[list[tuple[int, int]], list[int]]:
    """(micro_batch, grad_accum) pairs to try, and micro-batches skipped for divisibility."""
    forced = ov.micro_batch
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


def _timed(profile: ModelProfile, strategy: Strategy, topology: Topology, mb: int, accum: int,
           ov: Overrides, timing: WorkloadTiming | None) -> tuple[Strategy, StepTimeEstimate]:
    """`strategy` and its step time; a compile the plan proposed (not the user) is dropped when
    not predicted worth its compile time (`compile_choice.worth_compiling`)."""
    t = step_time(profile, strategy, topology, mb, accum, timing=timing)
    if strategy.compile and ov.compile is None:
        eager = dataclasses.replace(strategy, compile=False)
        t_eager = step_time(profile, eager, topology, mb, accum, timing=timing)
        if not worth_compiling(t_eager.step_time_s, t.step_time_s):
            return eager, t_eager
    return strategy, t


def candidates(profile: ModelProfile, topology: Topology, goal: Goal, ov: Overrides,
               usable: float, timing: WorkloadTiming | None = None,
               compile_check: CompileCheck | None = None) -> tuple[list[Candidate], list[int]]:
    """Every (strategy, precision, checkpointing mode, micro-batch) the overrides allow, with its
    memory and time (CPU: from the workload's timed steps, `timing`, when measured), and the
    micro-batches skipped because they do not divide the batch. Each strategy compiles as the
    `compile` override says, else where `compile_choice.compiles` proposes it (`compile_check`:
    Dynamo's trace of the workload) and it is predicted worth its compile time."""
    n = topology.world_size
    kinds = [k for k in STRATEGY_ORDER if k != "hybrid" or topology.num_nodes > 1]
    sharded = [k for k in kinds if k not in DDP_KINDS and ov.strategy in (None, k)]
    if n == 1 and ov.strategy is None:
        kinds = ["ddp"]  # one device: nothing to shard over; the runtime runs it unwrapped
    if (ov.tp or 1) > 1 and ov.strategy is None:
        kinds = [k for k in kinds if k not in DDP_KINDS] or ["fsdp_full"]
    batches, skipped = _batches(goal, n, ov, topology.device) if (ov.tp or 1) == 1 else ([], [])
    # every checkpointing mode (`search` keeps the forced one); a model without repeated blocks has
    # nothing to wrap: none alone
    modes = ("none",) if profile.num_blocks < 1 and ov.checkpointing is None else CHECKPOINTING

    def priced(kinds: list[str], offload: bool, unit: str) -> list[Candidate]:
        nonlocal skipped
        out = []
        for kind in kinds:
            # linear units: FSDP's hooks on each linear layer, so no compiled blocks
            compiled = unit == "block" and compiles(kind, topology, ov, compile_check)
            for tp in tp_degrees(kind, profile, topology, ov, unit):
                group = shard_group_size(kind, topology, tp)
                if tp == 1:
                    tp_batches = batches
                else:
                    # with TP, world / tp ranks take samples: a batch that does not split over
                    # them rules this degree out (said by the error when the degree was forced)
                    try:
                        tp_batches, tp_skipped = _batches(goal, n // tp, ov, topology.device)
                    except PlanError:
                        if ov.tp is not None:
                            raise
                        continue
                    if ov.tp is not None:
                        skipped = tp_skipped
                for precision, f8 in [(p, f) for p in precisions_for(topology, ov) for f in _float8s(topology, ov, p)]:
                    for ckpt in (m for m in modes if unit == "block" or linear_units_ok(
                            strategy=kind, tp=tp, compile=compiled, checkpointing=m)):
                        strategy = Strategy(kind=kind, precision=precision, checkpointing=ckpt,
                                            compile=compiled, compile_mode=ov.compile_mode or "default",
                                            tp=tp, offload=offload, float8=f8, reduce_dtype=ov.reduce_dtype or "fp32",
                                            fsdp_unit=unit)
                        for mb, accum in tp_batches:
                            mem = estimate_memory(profile, strategy, micro_batch=mb, world_size=n,
                                                  shard_group_size=group, device=topology.device,
                                                  optimizer=goal.optimizer)
                            s, t = _timed(profile, strategy, topology, mb, accum, ov, timing)
                            fits = mem.total_bytes <= usable and (
                                not offload or topology.device != "cuda"
                                or host_fits(mem.host_bytes, topology, goal.headroom))
                            out.append(Candidate(strategy=s, micro_batch=mb, grad_accum=accum,
                                                 memory=mem, time=t, fits=fits))
        return out

    unit = ov.fsdp_unit or "block"
    if ov.offload:
        return priced(sharded, True, unit), skipped
    out = priced(sharded if unit == "linear" else kinds, False, unit)
    # FSDP units of linear layers only where nothing fits with a block per unit: a smaller gathered
    # peak for more collectives, before CPU offload trades the host link for the model state
    if (ov.fsdp_unit is None and linear_units_ok(strategy=ov.strategy, tp=ov.tp, compile=ov.compile,
                                                      checkpointing=ov.checkpointing)
            and profile.linear_units_per_block > 1 and not any(c.fits for c in out)):
        out += priced(sharded, False, "linear")
    # CPU offload on GPUs only where nothing else fits: it trades the host link and the CPU's
    # optimizer step for the GPU memory of the model state
    if (ov.offload is None and topology.device == "cuda" and topology.host is not None
            and not any(c.fits for c in out)):
        out += priced(sharded, True, unit)
    return out, skipped


def dp_ranks(c: Candidate, n: int) -> int:
    """Ranks that take their own samples: all `n`, or n / tp under tensor parallelism."""
    return n // c.strategy.tp


def per_sample(c: Candidate) -> float:
    """Seconds per sample of the whole job: a TP candidate's tp ranks share each sample."""
    return c.time.step_time_s * c.strategy.tp / (c.micro_batch * c.grad_accum)


def units_per_s(c: Candidate, n: int, profile: ModelProfile) -> float:
    """The job's throughput on `n` ranks, in the profile's units (tokens, samples)."""
    return c.micro_batch * c.grad_accum * dp_ranks(c, n) * profile.units_per_sample / c.time.step_time_s


def _preference(c: Candidate) -> tuple[int, int, bool, int, int, float]:
    """Among near-ties: STRATEGY_ORDER, the smaller TP degree (fewer moving parts, more data
    parallelism), bf16 over float8 (no conversion, no float8 rounding), the lighter checkpointing
    (none, selective, every-other, full: the order of CHECKPOINTING), then the larger micro-batch
    (the model does not see the better kernel efficiency of larger batches), then speed."""
    s = c.strategy
    return (STRATEGY_ORDER.index(s.kind), s.tp, s.float8 != "none", CHECKPOINTING.index(s.checkpointing),
            -c.micro_batch, per_sample(c))


def choose(fitting: list[Candidate]) -> Candidate:
    """Fastest per sample; among those within TIE_TOLERANCE of it, the preferred one (bf16 over
    its float8 twin among them, `_preference`)."""
    best = min(per_sample(c) for c in fitting)
    return min((c for c in fitting if per_sample(c) <= best * (1 + TIE_TOLERANCE)), key=_preference)



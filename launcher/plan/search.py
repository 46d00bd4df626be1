"""The planner: enumerate candidate strategies, drop what does not fit, rank by predicted speed.

The search space (`candidates`): strategy {ddp, zero1, fsdp_grad_op, fsdp_full, hybrid (multi-node
only)} x precision (bf16 where the device has it, else fp16 + GradScaler on CUDA; fp32 and, where
the CPU lists a bf16 peak, bf16 on CPU) x activation checkpointing {none, selective, every-other,
full} x micro-batch (powers of two); torch.compile where `compile_choice` proposes it, priced by the
same cost model and explained in the reasons (`explain`). Nothing here encodes the seed rule ("DDP
when it fits, FSDP when it does not, DDP/hybrid on slow links"): it comes out of
`memory.estimate_memory` and `cost.step_time`.

Pure functions of the frozen specs: no torch, no I/O; never imports cli, backends, jobs, runtime,
results or report.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping

from launcher.alloc_conf import alloc_conf_env, installed_torch_version
from launcher.errors import PlanError
from launcher.hardware.types import Topology
from launcher.plan.candidates import candidates, check_forced, choose, dp_ranks, profile_for_goal, units_per_s
from launcher.plan.collectives import fsdp_units
from launcher.plan.compile_choice import decide
from launcher.plan.compile_probe import CompileCheck
from launcher.plan.cost import HOST_OP_RANGE_S, HOST_OP_S, LAUNCH_WAIT_PART, shard_group_size, step_time
from launcher.plan.explain import host_too_small, label, per_device, reasons, rejected, too_big, within_card
from launcher.plan.interval import step_interval
from launcher.plan.kernels import assumed_spread, priced, with_kernels
from launcher.plan.memory import MASTER_PARAM_BYTES, fmt_gib, usable_mem_bytes
from launcher.plan.offload import OFFLOAD_UNPRICED_LINK_SHARE, offload_s, steps_fused
from launcher.plan.step_probe import WorkloadTiming
from launcher.plan.types import Candidate, Overrides, Plan
from launcher.specs import GIB, Goal, ModelProfile, Strategy

logger = logging.getLogger(__name__)


def _env(topology: Topology) -> dict[str, str]:
    if topology.device == "cpu":
        # torchrun only sets OMP_NUM_THREADS=1 when nproc > 1; oversubscribed cores run 4x slower
        return {"OMP_NUM_THREADS": str(topology.rank_threads)}
    # fewer fragmentation OOMs with changing shapes; the memory model assumes it. Named as the
    # installed torch reads it (its version from the package metadata, read once: no torch)
    env = alloc_conf_env({}, installed_torch_version())
    if topology.intra_node.kind == "pcie-nop2p":
        # GeForce cards report P2P NCCL cannot use; without this NCCL can hang or corrupt data
        env["NCCL_P2P_DISABLE"] = "1"
    if topology.num_nodes > 1 and topology.inter_node and topology.inter_node.kind == "ethernet":
        # NCCL's TCP transport needs several sockets/threads to fill a fast NIC (NCCL env docs)
        env["NCCL_SOCKET_NTHREADS"] = "4"
        env["NCCL_NSOCKS_PERTHREAD"] = "4"
    return env


def plan(profile: ModelProfile, topology: Topology, goal: Goal, *, overrides: Overrides | None = None,
         timing: WorkloadTiming | None = None, compile_check: CompileCheck | None = None,
         compute_factor: Callable[[str], float] | None = None, correction_note: str = "",
         kernel_sources: Mapping[str, str] | None = None) -> Plan:
    """Recommend a strategy for training `profile` on `topology` towards `goal`, with reasons.

    `overrides` force the decisions they set; a forced plan that does not fit is still returned,
    its first reason starting "warning:". `timing`: the workload's own steps timed on this (CPU)
    host, every candidate's compute when timed at the goal's sequence length. `compile_check`:
    Dynamo's trace; without it (or a `compile` override) a GPU plan does not propose compile.
    `compute_factor`: this machine's tune corrections (precision -> factor on predicted compute),
    applied before the choice so that the choice, its reasons and every number shown come from one
    corrected estimate (`correction_note` says so). The kernels priced are the overrides', else the
    profile's, labelled by `kernel_sources` (role -> "declared" / "detected"; others "default").
    PlanError when nothing fits, or when an override is impossible."""
    ov = overrides or Overrides()
    check_forced(ov, profile, topology)
    kernels = priced(profile, ov, kernel_sources or {})
    profile = profile_for_goal(with_kernels(profile, kernels), goal)
    if timing is not None and timing.units_per_sample != profile.units_per_sample:
        timing = None  # timed at another sequence length: the rates' model applies
    n = topology.world_size
    usable = usable_mem_bytes(topology.accelerator, goal.headroom)
    cands, skipped = candidates(profile, topology, goal, ov, usable, timing, compile_check)
    if compute_factor is not None:
        cands = [c.with_compute_scaled(compute_factor(c.strategy.precision)) for c in cands]
    allowed = [c for c in cands if ov.strategy in (None, c.strategy.kind)
               and ov.checkpointing in (None, c.strategy.checkpointing)]
    fitting = [c for c in allowed if c.fits]
    warnings = []
    if fitting:
        chosen = choose(fitting)
    elif ov.forced:
        chosen = min(allowed, key=lambda c: c.memory.total_bytes)
        fitting_alt = [c for c in cands if c.fits]
        alt = f" ({label(choose(fitting_alt))} would fit)" if fitting_alt else ""
        if within_card(chosen, topology):
            # past the headroom the planner keeps for its own choices, not past the card: a run
            # sized by hand to fill the card is told its margin, not that it cannot run
            warnings.append(f"warning: the forced plan leaves less than the {goal.headroom:.0%} headroom: "
                            f"{label(chosen)}: {fmt_gib(chosen.memory.total_bytes)} of "
                            f"{topology.accelerator.mem_gib:.1f} GiB/{per_device(topology)}; it may run out of memory"
                            + alt)
        else:
            warnings.append(f"warning: the forced plan does not fit: {label(chosen)}: "
                            f"{too_big(chosen, usable, profile, topology)}; it will run out of memory" + alt)
    else:
        smallest = min(cands, key=lambda c: c.memory.total_bytes)
        if smallest.strategy.offload and smallest.memory.total_bytes <= usable and topology.host:
            raise PlanError(host_too_small(smallest, topology, goal.headroom))
        fixes = ["add GPUs or nodes (FSDP shards the model state over them)",
                 *(["enable activation checkpointing"] if not smallest.strategy.recomputes else []),
                 "shorten the sequence" if profile.sample_units == "tokens" else "use a smaller model"]
        raise PlanError(
            f"nothing fits on {n} x {topology.accelerator.name} ({fmt_gib(usable)} GiB usable "
            f"each): the smallest candidate, {label(smallest)} at micro-batch {smallest.micro_batch}, "
            f"needs {fmt_gib(smallest.memory.total_bytes)} GiB per {per_device(topology)}; "
            f"{', '.join(fixes[:-1])} or {fixes[-1]}")
    factor = 1.0 if compute_factor is None else compute_factor(chosen.strategy.precision)
    compiled = decide(chosen, profile, topology, ov, compile_check, timing=timing, compute_factor=factor)
    why = warnings + reasons(chosen, allowed, profile, topology, goal, usable, skipped, compiled)
    if correction_note:
        why.insert(1, correction_note)
    if chosen.strategy.offload:
        why.insert(1, _offload_reason(chosen, profile, topology, goal, ov, timing)
                   if topology.device == "cuda" else "CPU offload on CPU ranks: the state already "
                   "lives in host memory; FSDP's offload policy runs as on GPUs and moves nothing")
    if chosen.strategy.fsdp_unit == "linear" and ov.fsdp_unit is None:
        units = fsdp_units(profile, chosen.strategy)
        why.insert(1, f"FSDP units: each linear layer of a block and the block's rest ({units} units), as nothing "
                   "fits with a block per unit: fewer parameters gathered at once for more collectives "
                   "(--fsdp-unit block keeps blocks)")
    if (built := _built_on_host(profile, topology, chosen.strategy)) is not None:
        why.append(built)
    if timing is not None:
        why.append(f"step time: {timing.describe()}, plus the model's FSDP work and gloo collectives")
    if ov.forced:
        why.append("forced by overrides: " + ", ".join(f"{k}={v}" for k, v in ov.forced))
    chosen = dataclasses.replace(chosen, reason=why[0])
    # with TP, tp ranks share each sample: samples per step = mb x accum x world / tp
    global_batch = chosen.micro_batch * chosen.grad_accum * dp_ranks(chosen, n)
    t = chosen.time
    on_gpu = topology.device == "cuda"
    spread = assumed_spread(kernels, lambda ks: step_time(
        with_kernels(profile, ks), chosen.strategy, topology, chosen.micro_batch, chosen.grad_accum,
        timing=timing).step_time_s) if on_gpu else (1.0, 1.0, "")
    if on_gpu and (waiting := dict(t.compute_parts).get(LAUNCH_WAIT_PART)):  # the launches set the compute
        # at another cost an op, the compute is the launches then, or the GPU's own work where that is longer
        lo, hi = ((t.step_time_s + max(t.compute_s - waiting, t.compute_s * r / HOST_OP_S) - t.compute_s)
                  / t.step_time_s for r in HOST_OP_RANGE_S)
        spread = (spread[0] * lo, spread[1] * hi, "; ".join(filter(None, (spread[2], (
            f"the host's launches at {HOST_OP_S * 1e6:g} us an op ({lo:.2f}-{hi:.2f}x at "
            f"{HOST_OP_RANGE_S[0] * 1e6:g}-{HOST_OP_RANGE_S[1] * 1e6:g} us)")))))
    if on_gpu and chosen.strategy.offload:
        link_s = offload_s(profile, chosen.strategy, topology, shard_group_size(chosen.strategy.kind, topology,
                                                                                chosen.strategy.tp), 0.0, 0.0,
                           chosen.grad_accum)[0]
        hi = 1 + OFFLOAD_UNPRICED_LINK_SHARE * link_s / t.step_time_s
        spread = (spread[0], spread[1] * hi, "; ".join(filter(None, (spread[2], (
            f"CPU offload's copies, {OFFLOAD_UNPRICED_LINK_SHARE:.0%} of their time more (up to {hi:.2f}x) as "
            "one H200 measured")))))
    result = Plan(chosen=chosen, world_size=n, num_nodes=topology.num_nodes,
                  global_batch=global_batch, units_per_s=units_per_s(chosen, n, profile),
                  # weak scaling vs one device doing the same per-rank work with no communication
                  scaling_efficiency=t.compute_s / t.step_time_s if t.step_time_s else 1.0,
                  env=_env(topology), reasons=tuple(why),
                  rejected=tuple(rejected(chosen, cands, goal, topology, profile, usable)),
                  usable_mem_bytes=usable, compile=compiled, kernels=kernels,
                  step_interval=step_interval(
                      t.step_time_s, on_gpu=on_gpu, world_size=n, kernel_spread=spread,
                      seq_len=profile.units_per_sample if profile.sample_units == "tokens" else None))
    logger.debug("plan %s on %s: %s (%d candidates)", profile.name, topology.name, label(chosen), len(cands))
    return result


def _built_on_host(profile: ModelProfile, topology: Topology, strategy: Strategy) -> str | None:
    """A warning where the fp32 model built in host memory before it reaches the devices (runtime.build:
    by rank 0 alone for a sharded run over several ranks, by every rank otherwise) needs more than the
    node's host has."""
    host, g = topology.host, topology.devices_per_node
    once = strategy.builds_once(topology.world_size)
    each = MASTER_PARAM_BYTES * float(profile.num_params)
    if host is None or each * (1 if once else g) <= host.mem_gib * GIB:
        return None
    who = "rank 0 builds" if once else f"each of the node's {g} ranks builds"
    return (f"warning: {who} the whole fp32 model in host memory ({each / GIB:,.0f} GiB"
            f"{'' if once else f'; {each * g / GIB:,.0f} GiB'} against the node's {host.mem_gib:,.0f} GiB): the run "
            "will likely run out of host memory as it starts")


def _offload_reason(c: Candidate, profile: ModelProfile, topology: Topology, goal: Goal,
                    ov: Overrides, timing: WorkloadTiming | None) -> str:
    """What CPU offload keeps on the host and costs a step, against the fewest GPUs (doubling,
    nodes of the topology's size beyond one node) on which a plan fits without it."""
    host, t, n = topology.host, c.time, topology.world_size
    assert host is not None  # offload is priced only with a described host
    host_opt = dict(t.compute_parts).get("host optimizer", 0.0)
    cost = host_opt + t.comm_exposed_s if n == 1 else host_opt
    group = shard_group_size(c.strategy.kind, topology, c.strategy.tp)
    link_s = offload_s(profile, c.strategy, topology, group, 0.0, 0.0, c.grad_accum)[0]  # in all, hidden or not
    out = (f"CPU offload: {'nothing fits without it; ' if not ov.offload else ''}each rank's fp32 params, grads and "
           f"optimizer state ({fmt_gib(c.memory.host_bytes)} GiB) live in host memory "
           f"({fmt_gib(c.memory.host_bytes * topology.devices_per_node)} of the node's {host.mem_gib:,.0f} GiB) and "
           f"the optimizer steps on the CPU ({'fused' if steps_fused(profile, topology) else 'per-tensor loop'}): "
           f"{host_opt:.3g} s a step at {host.mem_bw_gb_s:g} GB/s of host memory bandwidth "
           f"({'measured here' if host.mem_bw_measured else 'the topology figure'}) shared by "
           f"{topology.devices_per_node} rank(s), plus copies over the "
           f"{host.link_gb_s:g} GB/s host link, {link_s:.3g} s of traffic a step: {cost / t.step_time_s:.0%} "
           "of the step is offload's")
    here = units_per_s(c, n, profile) / n
    node = max(topology.devices_per_node, 8)
    g = n * 2
    while g <= 64 * node and (g <= node or topology.inter_node is not None):
        shaped = topology.with_shape(num_nodes=max(1, g // node), devices_per_node=min(g, node))
        usable = usable_mem_bytes(shaped.accelerator, goal.headroom)
        try:
            cands, _ = candidates(profile, shaped, dataclasses.replace(goal, global_batch=None),
                                  dataclasses.replace(ov, offload=False, micro_batch=None), usable, timing)
        except PlanError:
            cands = []
        if fitting := [x for x in cands if x.fits]:
            best = choose(fitting)
            return (out + f"; without it {label(best)} fits from {g} GPUs: {units_per_s(best, g, profile) / g:,.0f} "
                          f"{profile.sample_units}/s per GPU against {here:,.0f} here")
        g *= 2
    return out

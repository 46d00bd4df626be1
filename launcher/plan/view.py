"""The text `dlaunch plan` prints for a Plan (the planner itself stays free of presentation).

Never imports cli, backends, jobs, runtime or report.
"""

from __future__ import annotations

from launcher.hardware.types import Topology
from launcher.plan.candidates import dp_ranks
from launcher.plan.checkpointing import describe
from launcher.plan.explain import kind_label, per_device, within_card
from launcher.plan.kernels import describe as kernels_priced
from launcher.plan.memory import fmt_gib
from launcher.plan.types import Plan
from launcher.specs import ModelProfile


def format_plan(plan: Plan, profile: ModelProfile, topology: Topology) -> str:
    """The text `dlaunch plan` prints: the chosen plan, its memory and time breakdown, why,
    the environment it sets, and the other candidates with the reason each lost."""
    c, dev = plan.chosen, topology.accelerator
    s, m, t = c.strategy, c.memory, c.time
    intra = topology.intra_node.kind + (f", {topology.inter_node.kind} between nodes"
                                        if topology.inter_node and topology.num_nodes > 1 else "")
    flags = [s.precision + (" + GradScaler" if s.uses_grad_scaler else "")
             + (f" + float8 ({s.float8})" if s.float8 != "none" else ""),
             describe(s.checkpointing), f"compile ({s.compile_mode})" if s.compile else "no compile",
             *(["CPU offload"] if s.offload else []),
             *(["gradients reduced in bf16"] if s.reduce_dtype == "bf16" else []),
             *(["FSDP units: each linear layer"] if s.fsdp_unit == "linear" else [])]
    per_gpu = plan.units_per_s / plan.world_size
    hidden = 1 - t.comm_exposed_s / t.comm_total_s if t.comm_total_s else 1.0
    lines = [
        f"Plan for {profile.name} on {topology.name}: {plan.world_size} x {dev.name} "
        f"({topology.num_nodes} node{'s' if topology.num_nodes > 1 else ''}, {intra})",
        f"  strategy     {kind_label(c)}, {', '.join(flags)}"
        + (f" (TP {s.tp} inside each node x DP {dp_ranks(c, plan.world_size)})" if s.tp > 1 else ""),
        f"  batch        global {plan.global_batch} = micro-batch {c.micro_batch} x "
        f"{dp_ranks(c, plan.world_size)} {'data-parallel ' if s.tp > 1 else ''}ranks x "
        f"{c.grad_accum} accumulation step{'s' if c.grad_accum > 1 else ''}",
        f"  memory/{per_device(topology):<6}{fmt_gib(m.total_bytes)} GiB of {fmt_gib(plan.usable_mem_bytes)} "
        f"usable ({dev.mem_gib:g} GiB total)"
        + ("" if c.fits else "  INSIDE THE HEADROOM" if within_card(c, topology) else "  DOES NOT FIT"),
        f"               params {fmt_gib(m.params_bytes)}  grads {fmt_gib(m.grads_bytes)}  "
        f"optimizer {fmt_gib(m.optimizer_bytes)}  activations {fmt_gib(m.activations_bytes)}  "
        f"overhead {fmt_gib(m.overhead_bytes)}"
        + (f"; host {fmt_gib(m.host_bytes)} GiB per rank (offloaded state)" if m.host_bytes else ""),
        f"  step time    {t.step_time_s:.3g} s"
        + (f" ({plan.step_interval.label()})" if plan.step_interval else "")
        + f" = compute {t.compute_s:.3g} + exposed "
        f"communication {t.comm_exposed_s:.3g} (of {t.comm_total_s:.3g} s, {hidden:.0%} hidden)"
        + (f" + contention {t.contention_s:.3g}" if t.contention_s else "")
        + (f" + wait for the slowest rank {t.sync_wait_s:.3g}" if t.sync_wait_s else ""),
        *(["  compute      " + "  ".join(f"{name} {sec:.3g}" for name, sec in t.compute_parts)]
          if t.compute_parts and sum(sec > 0 for _, sec in t.compute_parts) > 1 else []),
        f"  throughput   {plan.units_per_s:,.0f} {profile.sample_units}/s ({per_gpu:,.0f} per "
        f"device), scaling efficiency {plan.scaling_efficiency:.0%} (compute over the whole step)",
        *([f"  interval     the middle {plan.step_interval.coverage:.0%} of measured/predicted "
            f"in the model's validation: {plan.step_interval.basis}"] if plan.step_interval else []),
        f"  assumptions  {m.assumptions}",
        # the kernels are GPU cost terms: a CPU's measured rates price every kernel alike
        *([f"  kernels      {kernels_priced(plan.kernels)}"
           + ("" if topology.device == "cuda" else " (priced on GPUs only)")] if plan.kernels else []),
        *([f"  profile      {profile.profile_note}"] if profile.profile_note else []),
        "Why",
        *(f"  - {r}" for r in plan.reasons),
    ]
    if plan.env:
        lines += ["Environment", *(f"  {k}={v}" for k, v in sorted(plan.env.items()))]
    if plan.rejected:
        # as wide as the longest label ("FSDP grad-op+tp8"); 14 without TP, as before
        w = max(14, *(len(kind_label(r)) + 2 for r in plan.rejected))
        lines += ["Other candidates", f"  {'strategy':<{w}}{'prec':<8}{'ckpt':<12}{'mb x acc':<10}"
                                      f"{'GiB/' + per_device(topology):>9}{'step s':>9}  why not"]
        for r in plan.rejected:
            rs = r.strategy
            prec = {"none": rs.precision, "tensorwise": "fp8-tw", "rowwise": "fp8-rw"}[rs.float8]
            lines.append(f"  {kind_label(r):<{w}}{prec:<8}{rs.checkpointing:<12}"
                         f"{f'{r.micro_batch} x {r.grad_accum}':<10}{fmt_gib(r.memory.total_bytes):>9}"
                         f"{r.time.step_time_s:>9.3g}  {r.reason.split(': ', 1)[-1]}")
    return "\n".join(lines)

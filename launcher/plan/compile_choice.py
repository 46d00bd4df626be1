"""Whether the plan compiles the model (torch.compile), and the sentence that says why.

On a GPU the plan proposes compile when Dynamo took one forward whole where the chosen strategy
compiles it (`compile_probe`: the model's forward for one process and DDP, each block's for FSDP2),
in mode "default" (FSDP supports no CUDA graphs). The cost model prices it twice: compile changes
only the memory-bound passes (norms, activations, residual adds, casts), whose HBM traffic fused
kernels cut to COMPILE_MEMORY_FACTOR of eager's (a fit on the published eager/compile pairs, see
`cost`). A break declines it, named; so does an unfinished trace, a GPU too old for Triton, a plan
without a trace, or a predicted gain under MIN_COMPILE_GAIN. The factor rests on 7B-70B Llama
rows; for small, mostly memory-bound models it is an assumption, likely conservative: nanoGPT's
README reports GPT-2 124M going from ~250 to 135 ms per iteration with compile (1.85x), where the
model predicts +30% for gpt small at micro-batch 64 on H100.

On CPU the plan never proposes compile (CPU_REASON): the CPU model prices eager steps and has no
measure of compile's gain (none to 1.21x on the 2-core host of docs/benchmarks.md).

Pure: no torch, no I/O; never imports cli, backends, jobs, runtime, results or report.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from launcher.hardware.types import Topology
from launcher.plan.compile_probe import CompileCheck
from launcher.plan.cost import COMPILE_MEMORY_FACTOR, step_time
from launcher.plan.step_probe import WorkloadTiming
from launcher.plan.types import Candidate, CompileDecision, Overrides, StepTimeEstimate
from launcher.specs import ModelProfile

# Inductor, torch.compile's GPU backend, generates Triton kernels; Triton needs compute
# capability 7.0 or newer (torch/_inductor/exc.py, GPUTooOldForTriton).
TRITON_MIN_CAPABILITY = (7, 0)
# what COMPILE_MEMORY_FACTOR rests on (cost.py); tokens/s per GPU as published
GAIN_BASIS = ("a factor fit on the published eager/compile pairs (torchtitan Llama 3.1 8B, FSDP2 on 8 H100: 5,762 -> "
              "6,667 tokens/s/GPU, +16%, pytorch/torchtitan docs/performance.md Table 1; IBM's Llama 2 7B-70B rows; "
              "benchmarks/published), an assumption for other shapes")
CPU_REASON = ("compile: not proposed on CPU: the CPU model prices eager steps (the workload's own, "
              "timed here) and has no measure of compile's gain, which on this kind of host ranged "
              "from none to 1.21x (gpt tiny bf16, `dlaunch lab`, docs/benchmarks.md) after a first "
              "step of 20-30 s; `dlaunch lab` measures it for this workload, --compile turns it on")
# compile must be predicted this much faster to be proposed: the model is not more accurate than
# a few percent (candidates.TIE_TOLERANCE), and a smaller gain does not repay the compile time
MIN_COMPILE_GAIN = 0.02


def worth_compiling(eager_s: float, compiled_s: float) -> bool:
    """True when the compiled step is predicted at least MIN_COMPILE_GAIN faster."""
    return eager_s >= compiled_s * (1 + MIN_COMPILE_GAIN)


def _too_old(topology: Topology) -> bool:
    cc = topology.accelerator.compute_capability
    return cc is not None and tuple(cc) < TRITON_MIN_CAPABILITY


def compiles(kind: str, topology: Topology, ov: Overrides, check: CompileCheck | None) -> bool:
    """The compile flag of strategy `kind`'s candidates: the user's override, else on a GPU new
    enough for Triton where Dynamo traced no break (kept only where `worth_compiling`)."""
    if ov.compile is not None:
        return ov.compile
    if topology.device != "cuda" or _too_old(topology) or check is None or check.error:
        return False
    return check.breaks(kind)[0] == 0


def _priced(c: Candidate, flag: bool, profile: ModelProfile, topology: Topology,
            timing: WorkloadTiming | None) -> StepTimeEstimate:
    """`c`'s step time with compile `flag` (the other terms as `c`'s)."""
    strategy = dataclasses.replace(c.strategy, compile=flag)
    return step_time(profile, strategy, topology, c.micro_batch, c.grad_accum, timing=timing)


def _where(c: Candidate, topology: Topology) -> str:
    """How the runtime compiles under the chosen strategy (runtime/wrap.py)."""
    if topology.world_size == 1:
        return "the model's forward"
    if not c.strategy.shards_params:
        return "the model's forward, before DDP wraps it (Dynamo's DDP optimizer splits it at buckets)"
    return "each block's forward, before FSDP2's fully_shard (mode default: no CUDA graphs with FSDP)"


def decide(chosen: Candidate, profile: ModelProfile, topology: Topology, ov: Overrides, check: CompileCheck | None, *,
           timing: WorkloadTiming | None = None, compute_factor: float = 1.0) -> CompileDecision:
    """The plan's compile decision for `chosen`, with the predicted step time eager and compiled
    (compute times this machine's tune correction, `compute_factor`) and the reason it prints."""
    on = chosen.strategy.compile
    if topology.device != "cuda":
        if ov.compile is not None:
            reason = ("compile: on (--compile), not modelled on CPU (the step time is eager speed); "
                      "the first step compiles for tens of seconds" if on else "compile: off (--no-compile)")
            return CompileDecision(compile=on, decided_by="--compile" if on else "--no-compile", reason=reason)
        return CompileDecision(compile=False, decided_by="cpu", reason=CPU_REASON)
    if chosen.strategy.fsdp_unit == "linear":
        return CompileDecision(compile=False, decided_by="--fsdp-unit", reason=(
            "compile: off: under --fsdp-unit linear FSDP's hooks would sit inside each compiled block"))
    plain = _priced(chosen, False, profile, topology, timing).with_compute_scaled(compute_factor)
    eager = plain.step_time_s
    fused = _priced(chosen, True, profile, topology, timing).with_compute_scaled(compute_factor).step_time_s
    memory_s = dict(plain.compute_parts).get("memory-bound", 0.0)
    price = f"{eager:.3g} -> {fused:.3g} s/step predicted ({eager / fused - 1:+.0%} throughput)"
    priced: dict[str, Any] = dict(eager_step_time_s=eager, compiled_step_time_s=fused, basis=(
        f"compile's gain: the memory-bound passes (norms, activations, residual adds, casts: "
        f"{memory_s:.3g} s of the eager step) fused to x{COMPILE_MEMORY_FACTOR:g} of their HBM "
        f"traffic, {GAIN_BASIS}; the loss (outside the compiled forward), matmuls, attention, optimizer and "
        "communication unchanged"))
    kind = chosen.strategy.kind
    if ov.compile is not None:
        if on:
            return CompileDecision(compile=True, decided_by="--compile", **priced, reason=(
                f"compile: on (--compile), {_where(chosen, topology)}: {price}; the first step "
                "compiles for tens of seconds"))
        return CompileDecision(compile=False, decided_by="--no-compile", **priced,
                               reason=f"compile: off (--no-compile); compiled: {price}")
    if _too_old(topology):
        cc = ".".join(map(str, topology.accelerator.compute_capability or ()))
        return CompileDecision(compile=False, decided_by="gpu too old", reason=(
            f"compile: not proposed: torch.compile's GPU backend generates Triton kernels, which "
            f"need compute capability 7.0 or newer; {topology.accelerator.name} has {cc}"))
    if check is None:
        return CompileDecision(compile=False, decided_by="not traced", **priced, reason=(
            f"compile: not proposed: the workload's forward was not traced with Dynamo; where it "
            f"compiles whole, --compile gives {price}"))
    if check.error:
        return CompileDecision(compile=False, decided_by="dynamo trace", reason=(
            f"compile: not proposed: Dynamo could not trace one forward on the meta device "
            f"({check.error}); --compile tries it on the GPU (a compile error falls back to eager)"))
    breaks, first = check.breaks(kind)
    traced = check.traced(kind)
    if breaks:
        which = "1 break" if breaks == 1 else f"{breaks} breaks; the first"
        return CompileDecision(compile=False, decided_by="dynamo trace", graph_breaks=breaks,
                               first_break=first, **priced, reason=(
            f"compile: not proposed: Dynamo breaks the graph in {traced} on the meta device ({which}: {first}); each "
            f"break ends a fused region and fails --compile-strict; without breaks: {price}"))
    if not on:
        return CompileDecision(compile=False, decided_by="dynamo trace", graph_breaks=0, **priced, reason=(
            f"compile: not proposed: Dynamo traced {traced} on the meta device with 0 graph "
            f"breaks, but {price} is a gain under {MIN_COMPILE_GAIN:.0%} (within the model's "
            "accuracy), not worth the first step's compile time; --compile turns it on"))
    return CompileDecision(compile=True, decided_by="dynamo trace", graph_breaks=0, **priced, reason=(
        f"compile: proposed: Dynamo traced {traced} on the meta device with 0 graph breaks; compiled as "
        f"{_where(chosen, topology)}: {price}; the first step compiles for tens of seconds; --no-compile runs eagerly"))


__all__ = ["compiles", "decide", "worth_compiling", "MIN_COMPILE_GAIN", "CPU_REASON", "GAIN_BASIS",
           "TRITON_MIN_CAPABILITY"]

"""The run's attention, loss and norm kernels: inputs of the plan, each with where it came from.

The cost model prices the kernel a run calls (`ModelProfile.attention_kernel`, `loss_kernel`,
`norm_kernel`), and two runs of one model differ by it: FlashAttention's package against PyTorch's
SDPA, a fused cross entropy against the eager one. Each role takes the first of: the flag
(`--attention-kernel`, ...: "given"), the workload's module-level `KERNELS` table ("declared"),
what the meta-device profile saw the model call ("detected"), and what dlaunch's own workloads
call ("default"). The profile applies the last three (`workload_kernels`); the planner lays the
flags over them (`priced`) and the plan records and prints the result.

Detection is by name (`kernel_of`) of the torch functions, custom ops, modules and autograd
Functions the model's forward and loss reach, whether or not their package is installed (a class
named LigerRMSNorm is Liger's fused norm): what a meta-device trace can see. Which backend SDPA
picks, and kernels that run inside a compiled graph, it cannot.

Pure: no torch, no I/O; imports only the foundation, plan.types and plan.attention.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from launcher.errors import WorkloadError
from launcher.plan.attention import EAGER_HEAD_DIM
from launcher.plan.types import KERNEL_ROLES as ROLES
from launcher.plan.types import Overrides, PricedKernel
from launcher.specs import ModelProfile

# the field of each role on ModelProfile, RunSettings (the flag's knob) and Overrides
KNOBS: Mapping[str, str] = {role: f"{role}_kernel" for role in ROLES}
SDPA = "torch.nn.functional.scaled_dot_product_attention"
# a softmax over a square of scores (..., s, s): attention written out (profile_passes records it by this name)
SCORES_SOFTMAX = "torch.nn.functional.softmax"
# the torch functions the profile records when the model calls them (`profile_passes`)
WATCHED_FUNCTIONS = (SDPA, "torch.nn.functional.cross_entropy", "torch.nn.functional.layer_norm",
                     "torch.nn.functional.rms_norm")
# packages whose loss and norm classes are fused kernels (Triton or CUDA), by top-level module
_FUSED_PACKAGES = ("liger_kernel", "flash_attn", "apex")
_LOW_PRECISION_NORMS = ("LPLayerNorm", "LPRMSNorm")  # llm-foundry's: the norm in the compute dtype


def given(settings: Any) -> dict[str, Any]:
    """The kernel knobs of a RunSettings (or anything with those fields), by field: what `Overrides` takes."""
    return {knob: getattr(settings, knob) for knob in KNOBS.values()}


def declared(table: Mapping[str, str], workload: str) -> dict[str, str]:
    """The workload's `KERNELS` table (role -> kernel), checked: WorkloadError naming the known ones otherwise."""
    for role, kernel in table.items():
        if role not in ROLES:
            raise WorkloadError(f"workload {workload}: KERNELS has {role!r}; its keys are {', '.join(ROLES)}")
        if kernel not in ROLES[role]:
            raise WorkloadError(f"workload {workload}: KERNELS: unknown {role} kernel {kernel!r}; "
                                f"dlaunch prices {', '.join(ROLES[role])}")
    return dict(table)


def kernel_of(name: str) -> tuple[str, str] | None:
    """(role, kernel) a name the profile saw stands for, or None. `name` is a torch function's
    (WATCHED_FUNCTIONS), a custom op's ("flash_attn::_flash_attn_forward") or a class's
    "module.Class" (a module of the model, or an autograd Function of its graph)."""
    if name == SDPA:
        return "attention", "sdpa"
    if name == SCORES_SOFTMAX:
        return "attention", "eager"
    if name in WATCHED_FUNCTIONS:
        return ("loss", "eager") if name.endswith("cross_entropy") else ("norm", "eager")
    if name.startswith("flash_attn::"):  # flash-attn's ops (torch.library): its attention
        return "attention", "fa2"
    module, _, cls = name.rpartition(".")
    if cls.startswith("FlashAttn") and "flash_attn" in module:
        # flash-attn's autograd Functions; those of its Triton FlashAttention (flash_attn_triton,
        # which llm-foundry vendors) are the other kernel
        return "attention", "triton-fa" if "triton" in module else "fa2"
    fused = module.split(".")[0] in _FUSED_PACKAGES or cls.startswith(("Liger", "Fused", "MixedFused"))
    if "CrossEntropy" in cls:
        return "loss", "fused" if fused else "eager"
    if "LayerNorm" in cls or "RMSNorm" in cls:
        # a fused norm reads and writes the compute dtype once, as the low-precision kernel is
        # priced; any other (torch's, or a model's own that upcasts by hand) is autocast's eager
        return "norm", "low-precision" if fused or cls in _LOW_PRECISION_NORMS else "eager"
    return None


def detected(names: Iterable[str]) -> dict[str, str]:
    """role -> the kernel the names show, for each role they show one; a fused or package
    kernel wins over the default one (a model that calls both is priced by the one it chose),
    and both over attention written out (a softmax of scores beside SDPA: weights kept aside)."""
    seen: dict[str, set[str]] = {}
    for role, kernel in filter(None, map(kernel_of, names)):
        seen.setdefault(role, set()).add(kernel)
    return {role: sorted(kernels, key=lambda k: ((role, k) == ("attention", "eager"), k == ROLES[role][0],
                                                 ROLES[role].index(k)))[0]
            for role, kernels in seen.items()}


def workload_kernels(profile: ModelProfile, table: Mapping[str, str],
                     names: Iterable[str]) -> tuple[ModelProfile, dict[str, str]]:
    """The profile with the workload's own kernels (declared, else detected, else the default)
    and role -> "declared" / "detected" for those not left at the default source."""
    found = detected(names)
    sources = {role: "declared" if role in table else "detected" for role in ROLES if role in table or role in found}
    kernels: dict[str, Any] = {KNOBS[role]: table.get(role, found.get(role)) for role in sources}
    return dataclasses.replace(profile, **kernels), sources


def priced(profile: ModelProfile, ov: Overrides, sources: Mapping[str, str]) -> dict[str, PricedKernel]:
    """Role -> the kernel the overrides give, else the profile's, with its source (`sources`, else "default")."""
    return {role: PricedKernel(kernel=value, source="given") if (value := getattr(ov, knob)) is not None
            else PricedKernel(kernel=getattr(profile, knob), source=sources.get(role, "default"))
            for role, knob in KNOBS.items()}


def with_kernels(profile: ModelProfile, kernels: Mapping[str, PricedKernel]) -> ModelProfile:
    """The profile priced with `kernels` (role -> PricedKernel). Attention written out holds its scores
    for backward, a flash kernel none: given one where the profile saw the other, the scores it would
    hold are added (batch x heads x s x s fp32, the heads at EAGER_HEAD_DIM: an assumption) or dropped."""
    fields: dict[str, Any] = {KNOBS[role]: k.kernel for role, k in kernels.items()}
    scores, eager = profile.attention_scores_bytes_per_sample, fields.get("attention_kernel") == "eager"
    if eager and scores == 0:  # the FLOPs count 4 x batch x heads x s x s x head dim
        fields["attention_scores_bytes_per_sample"] = scores = profile.attention_flops_fwd_per_sample / EAGER_HEAD_DIM
        fields["activation_bytes_per_sample"] = profile.activation_bytes_per_sample + scores
    elif not eager and "attention_kernel" in fields and scores > 0:
        fields.update(attention_scores_bytes_per_sample=0.0, attention_scores_upcast_bytes_per_sample=0.0,
                      activation_bytes_per_sample=max(0.0, profile.activation_bytes_per_sample - scores))
    return dataclasses.replace(profile, **fields)


def assumed_spread(kernels: Mapping[str, PricedKernel],
                   step_s: Callable[[Mapping[str, PricedKernel]], float]) -> tuple[float, float, str]:
    """How far the step time moves if a kernel the plan assumed (source "default": neither told,
    declared nor seen) is another one it prices: (lowest, highest) ratio of `step_s` under the
    alternatives to `step_s(kernels)`, the roles' effects multiplied, and a note naming them
    ("" when nothing was assumed). A known kernel moves nothing: its interval stays the model's."""
    base = step_s(kernels)
    low, high, notes = 1.0, 1.0, []
    for role, k in kernels.items():
        if k.source != "default":
            continue
        # attention written out is never the unseen one: a profile that traced the model saw its softmax
        ratios = {alt: step_s({**kernels, role: PricedKernel(kernel=alt, source="default")}) / base
                  for alt in ROLES[role] if alt != k.kernel and (role, alt) != ("attention", "eager")}
        if all(abs(r - 1) < 1e-9 for r in ratios.values()):
            continue  # the model has no such work (no attention in an MLP): nothing assumed matters
        low, high = low * min(1.0, *ratios.values()), high * max(1.0, *ratios.values())
        notes.append(f"{role} {k.kernel} assumed (" + ", ".join(f"{alt} {r:.2f}x" for alt, r in ratios.items()) + ")")
    return low, high, "; ".join(notes)


def describe(kernels: Mapping[str, PricedKernel]) -> str:
    """'attention sdpa (detected), loss fused (given), norm eager (default)'."""
    return ", ".join(f"{role} {k.kernel} ({k.source})" for role, k in kernels.items())

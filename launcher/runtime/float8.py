"""Float8 training (strategy field `float8`): torchao's `Float8Linear` in place of the model's
linear layers, the rest of the step in bf16.

Which layers convert (`eligible`): on GPUs torchao's own filter (`_auto_filter_for_recipe`: both
dimensions multiples of 16, the float8 GEMM's requirement, and large enough to gain on an H100),
and never the output head (torchtitan and torchao keep the logits in bf16 for the loss's
accuracy). CPU ranks run torchao's emulation (`emulate=True`: the same casts, scales and amax
reductions, the GEMM in high precision), so the path is tested there; they skip only what the
multiple-of-16 and head rules skip. Under FSDP on GPUs tensorwise scaling all-gathers the weights
in float8 (`enable_fsdp_float8_all_gather`), half of bf16's bytes.

torchao is an optional dependency (`pip install 'dlaunch[float8]'`); imported only here, when a
run converts.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from launcher.specs import Strategy, require_torchao


def _head(model: torch.nn.Module) -> str | None:
    """The output head's name: the workload's `lm_head` / `head` / `output`, else the last linear."""
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    named = [n for n in linears if n.split(".")[-1] in ("lm_head", "head", "output")]
    return (named or linears or [None])[-1]


def eligible(model: torch.nn.Module, recipe: str, device_type: str) -> tuple[list[str], list[tuple[str, str]]]:
    """(names to convert, [(name, why skipped)]) of the model's linear layers."""
    from torchao.float8 import _auto_filter_for_recipe  # deferred: an optional package

    head = _head(model)
    fast = _auto_filter_for_recipe(recipe, filter_fqns=[])
    convert, skipped = [], []
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear):
            continue
        out_f, in_f = mod.weight.shape
        if name == head:
            skipped.append((name, "the output head (kept in bf16 for the loss)"))
        elif out_f % 16 or in_f % 16:
            skipped.append((name, f"{in_f}x{out_f}: float8 GEMMs need multiples of 16"))
        elif device_type == "cuda" and not fast(mod, name):
            skipped.append((name, f"{in_f}x{out_f}: too small to gain (torchao's {recipe} thresholds)"))
        else:
            convert.append(name)
    return convert, skipped


def convert(model: torch.nn.Module, strategy: Strategy, device_type: str) -> dict[str, Any]:
    """Swap the eligible linear layers for Float8Linear in place; what was converted and skipped."""
    require_torchao(strategy.float8)
    # torchao's import logs every compiled extension this machine cannot load (CUDA kernels on a
    # CPU host, Triton's absence) and torch's pytree deprecations: none of it is the run's
    quiet = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    finally:
        for q, level in zip(quiet, levels):
            q.setLevel(level)

    names, skipped = eligible(model, strategy.float8, device_type)
    config = Float8LinearConfig.from_recipe_name(strategy.float8)
    # float8 all-gathers under FSDP with tensorwise scaling, on GPUs: over gloo (CPU ranks) the
    # gathered float8 storage is refused ("invalid python storage", torch 2.13), so CPU ranks
    # gather bf16 and test the rest of the path
    fsdp_gather = strategy.shards_params and strategy.float8 == "tensorwise" and device_type == "cuda"
    config = dataclasses.replace(config, emulate=device_type != "cuda", enable_fsdp_float8_all_gather=fsdp_gather)
    chosen = set(names)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda _m, fqn: fqn in chosen)
    return {"recipe": strategy.float8, "converted": names, "skipped": [{"layer": n, "why": why} for n, why in skipped],
            "emulated": device_type != "cuda", "fsdp_float8_all_gather": fsdp_gather}

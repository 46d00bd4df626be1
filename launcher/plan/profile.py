"""Workload -> ModelProfile, measured on the meta device (no real memory, no real compute).

Parameters per dtype and as tensors, the largest block (FSDP's unit) from `blocks(model)`;
activations, the backward transient, FLOPs and aten ops (plan.profile_passes); the optimizer's
state per parameter (plan.workload_probe); the tensor-parallel degrees the workload accepts
(`tp_degrees`); the attention, loss and norm kernels with the source of each (plan.kernels). A
model of identical blocks (a transformer) runs through its first 1, 2 and 3 blocks only and is
scaled to all of them after checking the increments are equal: 70B in well under a second. A
profile that fails on the meta device is tried once more on a tiny real CPU batch, so the error
says whether the workload has a bug or is only not meta-safe.

Never imports cli, backends, jobs, runtime or report; torch only inside functions, so importing
this module stays cheap.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from launcher.errors import WorkloadError
from launcher.plan.blocks import first_blocks, repeated_container
from launcher.plan.kernels import declared, workload_kernels
from launcher.plan.profile_passes import PROFILE_BATCHES, TRANSIENT_BATCHES, Counts, measure
from launcher.plan.workload_probe import meta_error, optimizer_state
from launcher.specs import ModelProfile
from launcher.workload import Workload, batch_norms, linear_layers

log = logging.getLogger(__name__)

# tensor-parallel degrees the plan may propose: inside one node of up to 8 GPUs
TP_PROBE_DEGREES = (2, 4, 8)
# a model built on the meta device may say, in this attribute, how its profile differs from how
# it trains (workloads/hf_causal_lm.py: an MoE's experts evenly routed); the plan prints it
PROFILE_NOTE_ATTR = "dlaunch_profile_note"


@dataclass(frozen=True, kw_only=True)
class Profiled:
    """A workload's profile, and where its kernels came from (role -> "declared" / "detected"; absent: default)."""

    profile: ModelProfile
    kernel_sources: Mapping[str, str] = field(default_factory=dict)


def _extrapolated(workload: Workload, model: Any, param_keys: set[int], blocks: Sequence[Any],
                  container: Any, seen: set[str]) -> Counts | None:
    """`measure` of the whole model from its first 1, 2 and 3 blocks: each identical block adds the same
    saved bytes, FLOPs and ops, so the whole model is the 1-block model plus L-1 increments (Llama-3
    70B: 3 blocks instead of 80). None when the increments are unequal or the truncated model fails."""
    try:
        runs = []
        for count in (1, 2, 3):
            with first_blocks(container, count):
                # only the deepest truncation's transients are kept (below): backward runs there alone
                runs.append(measure(workload, model, param_keys, blocks[0], transients=count == 3, called=seen))
    except Exception as e:  # e.g. a forward that indexes layers by a configured count
        log.debug("block extrapolation not possible (%s: %s); profiling every block", type(e).__name__, e)
        return None
    one, two, three = runs
    steps = [b - a for a, b in zip(one, two)]
    additive = len(Counts._fields) - 2  # the two transients are taken from one block below
    if any(not math.isclose(c - b, step, rel_tol=1e-9, abs_tol=0.0)
           for b, c, step in list(zip(two, three, steps))[:additive]):
        log.debug("blocks do not add equal costs (%s, %s, %s); profiling every block", *runs)
        return None
    whole = Counts(*(a + (len(blocks) - 1) * step for a, step in zip(one, steps)))
    # a block's input and backward's peak transient do not add up over blocks: the block's, and
    # the deepest truncation's (exact where the peak is at the loss, as in a language model;
    # within a block's worth of gradients where it is inside the blocks)
    return whole._replace(block_input_bytes=one.block_input_bytes, transient1=three.transient1,
                          transient2=three.transient2)


def linear_units(blocks: Sequence[Any]) -> tuple[int, int]:
    """(linear_unit_params, linear_units_per_block) of `ModelProfile`: each block's linear layers FSDP units of
    their own, and what the block keeps beside them one more (runtime.wrap under `fsdp_unit` linear)."""
    largest = per_block = 0
    for block in blocks:
        linears = [sum(p.numel() for p in m.parameters()) for m in linear_layers(block)]
        rest = sum(p.numel() for p in block.parameters()) - sum(linears)
        largest, per_block = max(largest, rest, *linears), max(per_block, len(linears) + 1)
    return largest, per_block


def splits_logits(plan: dict[str, Any]) -> bool:
    """Whether a tp_plan leaves the model's output a DTensor split on its last dimension: the head's
    logits over the vocabulary, torchtitan's loss parallel (`use_local_output=False`, `Shard(-1)`).
    Read from the styles of single modules (a pattern with `*` is a layer inside the blocks, whose
    output feeds the next one) that hand a DTensor on: where a style names the layout it hands on
    (`desired_output_layouts`, PrepareModuleOutput's), that one."""
    from torch.distributed.tensor import Shard

    def hands_on(style: Any) -> tuple[Any, ...]:
        return tuple(getattr(style, "desired_output_layouts", None) or getattr(style, "output_layouts", ()) or ())

    return any("*" not in name and getattr(style, "use_local_output", True) is False
               and any(isinstance(p, Shard) and p.dim == -1 for p in hands_on(style))
               for name, style in plan.items())


def tp_degrees(workload: Workload) -> tuple[tuple[int, ...], bool]:
    """The degrees in TP_PROBE_DEGREES whose `tp_plan(model, d)` returns a plan (None: d does not divide
    the heads), each asked of a fresh meta model (the hook may mutate it), and whether the plans split
    the logits (`splits_logits`); ((), False) without the hook. A degree whose call raises is dropped
    with a warning (a forced --tp then says it is not accepted)."""
    if not workload.has_tp_plan:
        return (), False
    import torch

    out, split = [], False
    for d in TP_PROBE_DEGREES:
        try:
            with torch.device("meta"):
                model = workload.build_model()
            plan = workload.tp_plan(model, d)
        except Exception as e:  # noqa: BLE001 - the workload's hook: report, never crash the plan
            log.warning("%s: tp_plan(model, %d) failed (%s: %s); TP %d left out of the plan",
                        workload.path.name, d, type(e).__name__, e, d)
            continue
        if isinstance(plan, dict):
            out.append(d)
            split = split or splits_logits(plan)
    return tuple(out), split


def profile_workload(workload: Workload, *, extrapolate: bool = True) -> ModelProfile:
    """`profiled_workload`'s profile."""
    return profiled_workload(workload, extrapolate=extrapolate).profile


def profiled_workload(workload: Workload, *, extrapolate: bool = True) -> Profiled:
    """Measure a workload's model on the meta device (`extrapolate`: from its first blocks); WorkloadError
    if it is not meta-safe, or for a `KERNELS` table that names what dlaunch does not price."""
    import torch

    table = declared(workload.kernels, workload.path.name)  # a typo costs no profile
    t0 = time.perf_counter()
    model = None
    seen: set[str] = set()  # what the forward and loss called (plan.kernels.kernel_of)
    try:
        with torch.device("meta"):
            model = workload.build_model()
        params = list(model.parameters())
        if any(p.device.type != "meta" for p in params):
            raise WorkloadError(f"workload {workload.path.name}: build_model() made tensors off the meta device; "
                                "create parameters without an explicit device= so `with torch.device('meta')` applies")
        optimizer, state_bytes, fused = optimizer_state(workload, model, sum(p.numel() for p in params))
        blocks = workload.blocks(model)
        param_keys = {p.untyped_storage()._cdata for p in params}
        container = repeated_container(model, blocks) if extrapolate else None
        counts = (_extrapolated(workload, model, param_keys, blocks, container, seen)
                  if container is not None else None)
        if counts is None:
            counts = measure(workload, model, param_keys, blocks[0] if blocks else None, called=seen)
        seen.update(f"{type(m).__module__}.{type(m).__qualname__}" for m in model.modules())
    except Exception as e:  # a WorkloadError about the meta device already says what to do
        if isinstance(e, WorkloadError) and "meta device" in str(e):
            raise
        raise meta_error(workload, model, e) from e
    by_dtype: dict[str, int] = {}
    for p in params:
        dtype = str(p.dtype).removeprefix("torch.")
        by_dtype[dtype] = by_dtype.get(dtype, 0) + p.numel() * p.element_size()
    degrees, loss_parallel = tp_degrees(workload)
    slope = (counts.saved2 - counts.saved1) / (PROFILE_BATCHES[1] - PROFILE_BATCHES[0])
    per_sample = 1 / PROFILE_BATCHES[0]
    linear_unit, per_block = linear_units(blocks)
    profile = ModelProfile(
        name=workload.path.stem + "".join(f" {k}={v}" for k, v in vars(workload.cfg).items()
                                          if workload.defaults.get(k) != v),
        num_params=sum(p.numel() for p in params),
        bytes_by_dtype=by_dtype,
        num_blocks=len(blocks),
        largest_block_params=max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0),
        activation_bytes_per_sample=max(slope, 0.0),
        block_input_bytes_per_sample=counts.block_input_bytes * per_sample,
        flops_fwd_per_sample=counts.flops * per_sample,
        attention_flops_fwd_per_sample=counts.attention_flops * per_sample,
        conv_flops_fwd_per_sample=counts.conv_flops * per_sample,
        units_per_sample=workload.units_per_sample, sample_units=workload.sample_units,
        optimizer=optimizer, optimizer_state_bytes_per_param=state_bytes, optimizer_fused=fused,
        forward_ops=int(counts.ops), param_tensors=len(params), batch_norms=len(batch_norms(model)),
        math_attention_bytes_per_sample=counts.math_attention * per_sample,
        attention_scores_bytes_per_sample=counts.scores * per_sample,
        attention_scores_upcast_bytes_per_sample=counts.scores_upcast * per_sample,
        selective_saved_share=min(1.0, counts.block_selective / counts.block_saved) if counts.block_saved > 0 else None,
        backward_transient_bytes_per_sample=max(
            (counts.transient2 - counts.transient1) / (TRANSIENT_BATCHES[1] - TRANSIENT_BATCHES[0]), 0.0),
        tp_degrees=degrees, tp_loss_parallel=loss_parallel,
        linear_unit_params=linear_unit, linear_units_per_block=per_block,
        profile_note=str(getattr(model, PROFILE_NOTE_ATTR, "") or ""),
    )
    profile, sources = workload_kernels(profile, table, seen)
    log.debug("profiled %s in %.2f s", profile.name, time.perf_counter() - t0)
    return Profiled(profile=profile, kernel_sources=sources)

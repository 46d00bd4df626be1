"""Workload -> ModelProfile, measured on the meta device (no real memory, no real compute).

- parameters: counted per dtype; the largest block (FSDP's unit) from `blocks(model)`;
- activations: the forward runs under `saved_tensors_hooks` at two micro-batch sizes and the
  bytes autograd saves for backward are summed, each storage once and parameters left out;
  the slope is bytes per sample (the intercept, mostly weights saved by reference, is dropped);
- checkpointing keeps each block's input: a pre-hook on the first block, in the same pass;
- attention with dropout: what SDPA's math path (the one CPU runs it on) saves beyond flash's,
  the probabilities and dropout mask per score (MATH_ATTENTION_BYTES_PER_SCORE), in the same pass;
- the backward transient: the same passes run backward, and the most bytes backward holds at
  once beyond what the forward saved is kept per sample (parameter gradients are dropped as
  they land: the memory model counts them apart). For a language model it is the loss
  gradient over the vocabulary, two logits-sized tensors: 25 GiB for GPT-2 small at 64 x 1024
  tokens in fp32, which made an H100 run the plan said fits run out of memory;
- FLOPs: `FlopCounterMode` over the micro-batch-1 forward, attention added analytically (that
  pass replaces SDPA to measure flash attention's memory); the attention and convolution
  shares are kept apart (they run at other rates than matmuls: see plan.cost, plan.cpu_cost);
- operations: the aten ops that micro-batch-1 forward dispatches (what per-op overhead, the
  dominant cost of a tiny model on CPU, scales with), and the number of parameter tensors;
- a model of identical blocks (a transformer) runs through its first 1, 2 and 3 blocks only and
  is scaled to all of them, after checking the increments are equal: 70B in well under a second
  (backward, for its transient, runs through the 3 blocks only: the one truncation kept);
- the optimizer's state per parameter: built on the meta model, probed on CPU (plan.workload_probe);
- the tensor-parallel degrees the workload accepts: its `tp_plan(model, d)` called for d in
  TP_PROBE_DEGREES on a fresh meta model each (the hook may mutate the model), keeping those
  that return a plan (None: d does not divide the heads).

A profile that fails on the meta device is tried once more on a tiny real CPU batch
(plan.workload_probe), so the error says whether the workload has a bug or is only not meta-safe.

Never imports cli, backends, jobs, runtime or report; torch only inside functions, so importing
this module stays cheap.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from launcher.errors import WorkloadError
from launcher.plan.blocks import first_blocks, repeated_container
from launcher.plan.workload_probe import meta_error, optimizer_state
from launcher.specs import ModelProfile
from launcher.workload import Workload, batch_norms

log = logging.getLogger(__name__)

PROFILE_BATCHES = (1, 2)
# tensor-parallel degrees the plan may propose: inside one node of up to 8 GPUs
TP_PROBE_DEGREES = (2, 4, 8)
# backward's transient is measured apart, at micro-batches where what grows with the batch
# outweighs the one-off gradient of a parameter (a wide embedding's) that backward also makes
TRANSIENT_BATCHES = (8, 16)
# SDPA with dropout runs PyTorch's math path on CPU (the CPU flash kernel takes no dropout:
# sdp_utils_cpp.cpp `use_flash_attention_cpp` checks it), which saves per attention score what
# flash does not: the softmax probabilities (4 B fp32), the dropout mask (1 B, bool) and the
# dropped probabilities the matmul with v keeps (4 B) (`_scaled_dot_product_attention_math`).
# Measured on CPU (HF GPT-2 tiny, attn_pdrop 0.1, saved tensors): 10.0 B a score.
MATH_ATTENTION_BYTES_PER_SCORE = 9
# FlopCounterMode's names of the forward convolution ops
_CONV_OPS = ("convolution", "_convolution", "conv1d", "conv2d", "conv3d", "convolution_overrideable")


class Counts(NamedTuple):
    """What the profiling passes measure. Every field but `block_input_bytes` adds up over
    identical blocks (see `_extrapolated`)."""

    saved1: float  # bytes saved for backward at PROFILE_BATCHES[0]
    saved2: float  # ... at PROFILE_BATCHES[1]
    block_input_bytes: float  # the first block's input at PROFILE_BATCHES[0]
    flops: float  # forward FLOPs at PROFILE_BATCHES[0], attention included
    attention_flops: float  # of which scaled-dot-product attention (4 s^2 d per layer)
    conv_flops: float  # of which convolutions
    ops: float  # aten ops dispatched by that forward
    math_attention: float = 0.0  # at PROFILE_BATCHES[0]: SDPA's math path beyond flash (CPU dropout)
    transient1: float = 0.0  # backward's peak bytes beyond the saved, at TRANSIENT_BATCHES[0]
    transient2: float = 0.0  # ... at TRANSIENT_BATCHES[1]


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def meta_batch(workload: Workload, micro_batch: int) -> object:
    """A batch of `micro_batch` samples with the dataset's shapes and dtypes, on the meta device."""
    # deferred: only a profile missing from the cache needs torch
    import torch
    from torch.utils.data import default_collate

    real = default_collate(workload.first_samples(1) * micro_batch)

    def to_meta(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return torch.empty_like(x, device="meta")
        if isinstance(x, tuple | list):
            return type(x)(to_meta(v) for v in x)
        if isinstance(x, dict):
            return {k: to_meta(v) for k, v in x.items()}
        return x

    return to_meta(real)


def _flash_like_sdpa() -> Any:
    """A TorchFunctionMode that makes SDPA save what flash attention saves.

    On meta, SDPA decomposes to the math path and saves the s x s attention matrix; the
    kernels that actually run (flash on CUDA, the flash kernel on CPU) keep only q, k, v, the
    output and a log-sum-exp per row. Without this, Llama-3 8B at 8k tokens would "need" 380 GB
    of activations per sample.
    """
    # deferred: only a profile missing from the cache needs torch
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    class FlashLike(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, q: Any, k: Any, v: Any) -> Any:
            out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
            lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            q, k, v, _, _ = ctx.saved_tensors
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    class Mode(TorchFunctionMode):
        # attention FLOPs, as FlopCounterMode counts SDPA: q @ k^T and scores @ v
        attention_flops = 0
        # what the math path would save beyond this, where attention has dropout
        math_attention_bytes = 0

        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func is F.scaled_dot_product_attention:
                q, k, v = args[:3]
                b_h_sq = q.numel() // q.shape[-1]
                self.attention_flops += 2 * b_h_sq * k.shape[-2] * (q.shape[-1] + v.shape[-1])
                dropout = (kwargs or {}).get("dropout_p", args[4] if len(args) > 4 else 0.0)
                if dropout:
                    self.math_attention_bytes += MATH_ATTENTION_BYTES_PER_SCORE * b_h_sq * k.shape[-2]
                return FlashLike.apply(q, k, v)
            return func(*args, **(kwargs or {}))

    return Mode()


def _op_counter() -> Any:
    """A TorchDispatchMode that counts the aten ops dispatched under it (in `ops`)."""
    # deferred: only a profile missing from the cache needs torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpCounter(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.ops += 1
            return func(*args, **(kwargs or {}))

    return OpCounter()


class _NewBytes:
    """Live and peak bytes of the storages created while entered (a TorchDispatchMode, built
    on first use so that importing this module stays torch-free). Meta storages have sizes and
    are freed like real ones, so this measures backward's transient memory with no memory."""

    def __init__(self) -> None:
        # deferred: only a profile missing from the cache needs torch
        import weakref

        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        outer = self
        self.live = 0
        self.peak = 0
        tracked: set[int] = set()

        def free(key: int, nbytes: int) -> None:
            tracked.discard(key)
            outer.live -= nbytes

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                                   kwargs: Any = None) -> Any:
                out = func(*args, **(kwargs or {}))
                for t in tree_flatten(out)[0]:
                    if not isinstance(t, torch.Tensor):
                        continue
                    storage = t.untyped_storage()
                    key = id(storage)
                    if key in tracked:
                        continue
                    tracked.add(key)
                    n = storage.nbytes()
                    outer.live += n
                    outer.peak = max(outer.peak, outer.live)
                    weakref.finalize(storage, free, key, n)
                return out

        self.mode = Mode()


def _backward_transient(loss: Any, params: Sequence[Any], tracker: _NewBytes) -> float:
    """The most bytes `loss.backward()` holds at once beyond what the forward left live,
    with each parameter's gradient dropped as it lands (the memory model counts gradients
    apart); 0 when backward does not run on the meta device (the model then counts none).
    `tracker` watched the forward, so the saved tensors backward frees are seen to go."""
    def drop(p: Any) -> None:
        p.grad = None

    hooks = [p.register_post_accumulate_grad_hook(drop) for p in params if p.requires_grad]
    start = tracker.live
    tracker.peak = start
    try:
        with tracker.mode:
            loss.backward()
    except Exception as e:  # an op without a meta backward: the transient stays unmeasured
        log.debug("backward on the meta device failed (%s: %s); no backward transient",
                  type(e).__name__, e)
        return 0.0
    finally:
        for h in hooks:
            h.remove()
    return float(tracker.peak - start)


def _saved_bytes(workload: Workload, model: Any, micro_batch: int, param_keys: set[int],
                 first_block: Any = None, *, count_flops: bool = False,
                 backward: bool = False) -> tuple[int, int, tuple[float, float, float, float], int, float]:
    """Bytes autograd saves for backward in one forward (each storage once, no parameters),
    the bytes of the first block's input (what checkpointing keeps per block), with
    `count_flops` the forward FLOPs (FlopCounterMode plus the attention it cannot see here;
    all, attention, convolutions; then SDPA's math-path bytes beyond flash's) and the number
    of aten ops the forward dispatched, and with `backward` backward's transient bytes
    (`_backward_transient`; else 0)."""
    # deferred: only a profile missing from the cache needs torch
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    block_in: list[int] = []

    def hook(module: Any, args: tuple[Any, ...]) -> None:
        block_in.append(sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor)))

    handle = first_block.register_forward_pre_hook(hook) if first_block is not None else None
    seen: set[int] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in seen and key not in param_keys:
            seen.add(key)
            total += storage.nbytes()
        return t

    batch = meta_batch(workload, micro_batch)
    counter = FlopCounterMode(display=False) if count_flops else contextlib.nullcontext()
    ops = _op_counter() if count_flops else contextlib.nullcontext()
    sdpa = _flash_like_sdpa()
    # only backward's transient reads the tracker: a forward-only pass skips its per-op
    # bookkeeping (a weakref finalizer per new storage)
    tracker = _NewBytes() if backward else None
    try:
        with counter, ops, sdpa, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                tracker.mode if tracker is not None else contextlib.nullcontext():
            loss = workload.loss_fn(model, batch)
    finally:
        if handle is not None:
            handle.remove()
    transient = (_backward_transient(loss, list(model.parameters()), tracker)
                 if tracker is not None else 0.0)
    del loss
    flops = (0.0, 0.0, 0.0, 0.0)
    if isinstance(counter, FlopCounterMode):
        by_op = counter.get_flop_counts().get("Global", {})
        conv = sum(n for op, n in by_op.items() if getattr(op, "__name__", str(op)).split(".")[0] in _CONV_OPS)
        attention = float(sdpa.attention_flops)
        flops = (float(counter.get_total_flops()) + attention, attention, float(conv),
                 float(sdpa.math_attention_bytes))
    return total, (block_in[0] if block_in else 0), flops, getattr(ops, "ops", 0), transient


def _passes(workload: Workload, model: Any, param_keys: set[int], first_block: Any, *,
            transients: bool = True) -> Counts:
    """Saved bytes at micro-batch 1 and 2, the first block's input bytes, and the FLOPs and
    aten ops at 1; with `transients`, backward's transient at TRANSIENT_BATCHES (else 0: the
    two backward passes are a third of a profile's time, skipped where nobody reads them)."""
    saved1, block_in, (flops, attention, conv, math_attention), ops, _ = _saved_bytes(
        workload, model, PROFILE_BATCHES[0], param_keys, first_block, count_flops=True)
    saved2, _, _, _, _ = _saved_bytes(workload, model, PROFILE_BATCHES[1], param_keys)
    transient1, transient2 = ((_saved_bytes(workload, model, mb, param_keys, backward=True)[4]
                               for mb in TRANSIENT_BATCHES) if transients else (0.0, 0.0))
    return Counts(saved1, saved2, block_in, flops, attention, conv, ops, math_attention,
                  transient1, transient2)


def _extrapolated(workload: Workload, model: Any, param_keys: set[int], blocks: Sequence[Any],
                  container: Any) -> Counts | None:
    """`_passes` of the whole model from forwards through its first 1, 2 and 3 blocks.

    Each identical block adds the same saved bytes, FLOPs and ops, so the whole model is the
    1-block model plus (L-1) block increments: Llama-3 70B profiles from 3-block forwards
    instead of 80.
    The 3-block pass checks that the increments really are equal; None (profile the whole
    model) when they are not or the truncated model does not run.
    """
    try:
        runs = []
        for count in (1, 2, 3):
            with first_blocks(container, count):
                # only the deepest truncation's transients are kept (below): backward runs
                # there alone
                runs.append(_passes(workload, model, param_keys, blocks[0],
                                    transients=count == 3))
    except Exception as e:  # e.g. a forward that indexes layers by a configured count
        log.debug("block extrapolation not possible (%s: %s); profiling every block",
                  type(e).__name__, e)
        return None
    one, two, three = runs
    steps = [b - a for a, b in zip(one, two)]
    additive = len(Counts._fields) - 2  # the two transients are taken from one block below
    if any(not math.isclose(c - b, step, rel_tol=1e-9, abs_tol=0.0)
           for b, c, step in list(zip(two, three, steps))[:additive]):
        log.debug("blocks do not add equal costs (%s, %s, %s); profiling every block", *runs)
        return None
    extra = len(blocks) - 1
    whole = Counts(*(a + extra * step for a, step in zip(one, steps)))
    # a block's input and backward's peak transient do not add up over blocks: the block's, and
    # the deepest truncation's (exact where the peak is at the loss, as in a language model;
    # within a block's worth of gradients where it is inside the blocks)
    return whole._replace(block_input_bytes=one.block_input_bytes, transient1=three.transient1,
                          transient2=three.transient2)


# a model built on the meta device may say, in this attribute, how its profile differs from how
# it trains (workloads/hf_causal_lm.py: an MoE's experts evenly routed); the plan prints it
PROFILE_NOTE_ATTR = "dlaunch_profile_note"


def tp_degrees(workload: Workload) -> tuple[int, ...]:
    """The degrees in TP_PROBE_DEGREES whose `tp_plan(model, d)` returns a plan, each asked of
    a fresh meta model; () without the hook. A degree whose call raises is dropped with a
    warning: the plan must not die of it (a forced --tp then says the degree is not accepted,
    and the run shows the hook's traceback)."""
    if not workload.has_tp_plan:
        return ()
    import torch

    out = []
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
    return tuple(out)


def profile_workload(workload: Workload, *, extrapolate: bool = True) -> ModelProfile:
    """Measure a workload's model on the meta device; WorkloadError if it is not meta-safe.

    With `extrapolate`, a model of identical blocks is measured through its first few blocks
    and scaled (exactly: see `_extrapolated`); otherwise every block runs.
    """
    # deferred: only a profile missing from the cache needs torch
    import torch

    t0 = time.perf_counter()
    model = None
    try:
        with torch.device("meta"):
            model = workload.build_model()
        params = list(model.parameters())
        if any(p.device.type != "meta" for p in params):
            raise WorkloadError(f"workload {workload.path.name}: build_model() made tensors off the "
                                "meta device; create parameters without an explicit device= so "
                                "`with torch.device('meta')` applies")
        optimizer, state_bytes = optimizer_state(workload, model, sum(p.numel() for p in params))
        blocks = workload.blocks(model)
        param_keys = {p.untyped_storage()._cdata for p in params}
        container = repeated_container(model, blocks) if extrapolate else None
        measured = (_extrapolated(workload, model, param_keys, blocks, container)
                    if container is not None else None)
        if measured is None:
            measured = _passes(workload, model, param_keys, blocks[0] if blocks else None)
        counts = measured
    except WorkloadError as e:
        if "meta device" in str(e):  # tensors made off the meta device: already says what to do
            raise
        raise meta_error(workload, model, e) from e
    except Exception as e:
        raise meta_error(workload, model, e) from e
    by_dtype: dict[str, int] = {}
    for p in params:
        by_dtype[_dtype_name(p.dtype)] = by_dtype.get(_dtype_name(p.dtype), 0) + p.numel() * p.element_size()
    slope = (counts.saved2 - counts.saved1) / (PROFILE_BATCHES[1] - PROFILE_BATCHES[0])
    per_sample = 1 / PROFILE_BATCHES[0]
    block_params = [sum(p.numel() for p in b.parameters()) for b in blocks]
    profile = ModelProfile(
        name=workload.path.stem + "".join(f" {k}={v}" for k, v in vars(workload.cfg).items()
                                          if workload.defaults.get(k) != v),
        num_params=sum(p.numel() for p in params),
        bytes_by_dtype=by_dtype,
        num_blocks=len(blocks),
        largest_block_params=max(block_params, default=0),
        activation_bytes_per_sample=max(slope, 0.0),
        block_input_bytes_per_sample=counts.block_input_bytes * per_sample,
        flops_fwd_per_sample=counts.flops * per_sample,
        attention_flops_fwd_per_sample=counts.attention_flops * per_sample,
        conv_flops_fwd_per_sample=counts.conv_flops * per_sample,
        units_per_sample=workload.units_per_sample,
        sample_units=workload.sample_units,
        optimizer=optimizer,
        optimizer_state_bytes_per_param=state_bytes,
        forward_ops=int(counts.ops),
        param_tensors=len(params),
        batch_norms=len(batch_norms(model)),
        math_attention_bytes_per_sample=counts.math_attention * per_sample,
        backward_transient_bytes_per_sample=max(
            (counts.transient2 - counts.transient1) / (TRANSIENT_BATCHES[1] - TRANSIENT_BATCHES[0]),
            0.0),
        tp_degrees=tp_degrees(workload),
        profile_note=str(getattr(model, PROFILE_NOTE_ATTR, "") or ""),
    )
    log.debug("profiled %s in %.2f s", profile.name, time.perf_counter() - t0)
    return profile

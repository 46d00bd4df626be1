"""One forward of a workload's model on the meta device (no real memory, no real compute),
measured; plan.profile scales these passes over the blocks into a ModelProfile.

- activations: the forward runs under `saved_tensors_hooks` at two micro-batch sizes and the
  bytes autograd saves for backward are summed, each storage once and parameters left out;
- checkpointing keeps each block's input: a pre-hook on the first block, in the same pass;
- attention with dropout: what SDPA's math path (CPU's) saves beyond flash's, in the same pass;
- selective checkpointing: in the same pass, the first block's saved bytes and the outputs of
  the ops its save list names (`specs.SELECTIVE_SAVED_MATMULS`, every second one, and
  `SELECTIVE_SAVED_OPS`: what `runtime.wrap`'s policy keeps of the block), whose ratio is the
  share of a block selective checkpointing keeps;
- the backward transient: the same passes run backward, and the most bytes backward holds at
  once beyond what the forward saved is kept per sample (parameter gradients are dropped as
  they land: the memory model counts them apart). For a language model it is the loss
  gradient over the vocabulary, two logits-sized tensors: 25 GiB for GPT-2 small at 64 x 1024
  tokens in fp32, which made an H100 run the plan said fits run out of memory;
- FLOPs: `FlopCounterMode` over the micro-batch-1 forward, attention added analytically (that
  pass replaces SDPA to measure flash attention's memory); the attention and convolution
  shares are kept apart (they run at other rates than matmuls: see plan.cost, plan.cpu_cost);
- operations: the aten ops that micro-batch-1 forward dispatches (what per-op overhead, the
  dominant cost of a tiny model on CPU, scales with);
- kernels: in that pass, by name (plan.kernels.kernel_of), the attention, loss and norm
  functions the forward and loss call (WATCHED_FUNCTIONS; a softmax only over a square of
  scores, attention written out: SCORES_SOFTMAX), the custom ops they dispatch
  (flash-attn's, whose attention FLOPs are counted as SDPA's are) and the autograd Functions in
  the loss's graph (a fused loss called in `loss_fn`).

Never imports cli, backends, jobs, runtime or report; torch only inside functions (only a
profile missing from the cache needs it), so importing this module stays cheap.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

from launcher.plan.kernels import SCORES_SOFTMAX, WATCHED_FUNCTIONS
from launcher.plan.kernels import SDPA as SDPA_NAME
from launcher.specs import SELECTIVE_SAVED_MATMULS, SELECTIVE_SAVED_OPS
from launcher.workload import Workload

log = logging.getLogger(__name__)

PROFILE_BATCHES = (1, 2)
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
_TORCH_OP_NAMESPACES = ("aten", "prims", "prim")  # the other ops are a package's custom ops


class Counts(NamedTuple):
    """What the profiling passes measure. Every field but `block_input_bytes` and the
    transients adds up over identical blocks (plan.profile scales them so)."""

    saved1: float  # bytes saved for backward at PROFILE_BATCHES[0]
    saved2: float  # ... at PROFILE_BATCHES[1]
    block_input_bytes: float  # the first block's input at PROFILE_BATCHES[0]
    flops: float  # forward FLOPs at PROFILE_BATCHES[0], attention included
    attention_flops: float  # of which attention (4 s^2 d per layer, SDPA's or written out)
    conv_flops: float  # of which convolutions
    ops: float  # aten ops dispatched by that forward
    math_attention: float = 0.0  # at PROFILE_BATCHES[0]: SDPA's math path beyond flash (CPU dropout)
    block_saved: float = 0.0  # at PROFILE_BATCHES[0]: what the first block saves for backward
    block_selective: float = 0.0  # ... and what selective checkpointing's save list keeps of it
    scores: float = 0.0  # at PROFILE_BATCHES[0]: attention written out, the bytes of its softmaxed scores
    scores_upcast: float = 0.0  # ... of those, softmaxed into fp32 (`softmax(dtype=torch.float32)`)
    # the last two, which do not add up over blocks (plan.profile's extrapolation relies on their place)
    transient1: float = 0.0  # backward's peak bytes beyond the saved, at TRANSIENT_BATCHES[0]
    transient2: float = 0.0  # ... at TRANSIENT_BATCHES[1]


def meta_batch(workload: Workload, micro_batch: int) -> object:
    """A batch of `micro_batch` samples with the dataset's shapes and dtypes, on the meta device."""
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
    """A TorchFunctionMode that makes SDPA save what flash attention saves. On meta, SDPA
    decomposes to the math path and saves the s x s attention matrix; the kernels that actually
    run (flash on CUDA, the flash kernel on CPU) keep only q, k, v, the output and a log-sum-exp
    per row. Without this, Llama-3 8B at 8k tokens would "need" 380 GB of activations a sample."""
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

    watched = {getattr(F, name.rpartition(".")[2]): name for name in WATCHED_FUNCTIONS
               if hasattr(F, name.rpartition(".")[2])}
    softmaxes = (F.softmax, torch.softmax, torch.Tensor.softmax)
    matmuls = (torch.matmul, torch.Tensor.matmul, torch.bmm, torch.Tensor.bmm)  # `a @ b` arrives as Tensor.matmul

    def square(t: Any) -> bool:  # (..., s, s): attention's scores, not a router's or the vocabulary's
        return getattr(t, "ndim", 0) >= 3 and t.shape[-1] == t.shape[-2]

    class Mode(TorchFunctionMode):
        attention_flops = 0  # as FlopCounterMode counts SDPA: q @ k^T and scores @ v
        # the same of attention written out (matmuls over a square: attention's only where the pass
        # softmaxed scores) and of nn.MultiheadAttention's, which FlopCounterMode counts itself
        square_flops = mha_flops = 0
        scores_bytes = 0  # what its softmaxes output (held for backward, by softmax's and the next matmul's)
        upcast_bytes = 0  # of those, what a softmax asked for in fp32 (Hugging Face's eager attention)
        math_attention_bytes = 0  # what the math path would save beyond this, where attention has dropout

        def __init__(self) -> None:
            super().__init__()
            self.called: set[str] = set()  # of WATCHED_FUNCTIONS, those called (plan.kernels)
            self.in_block = False  # inside the first block: what selective checkpointing keeps is counted
            self.block_kept = 0  # SDPA's outputs there (out and the log-sum-exp: in the save list)

        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            x = args[0] if args else kwargs.get("input")
            if func in watched:
                self.called.add(watched[func])
            elif func in softmaxes and square(x):
                self.called.add(SCORES_SOFTMAX)
                at = 3 if func is F.softmax else 2  # its dtype's place: F.softmax(input, dim, _stacklevel, dtype)
                upcast = kwargs.get("dtype", args[at] if len(args) > at else None) == torch.float32
                self.scores_bytes += (nbytes := x.numel() * x.element_size())
                self.upcast_bytes += nbytes if upcast else 0
            elif func in matmuls:
                out = func(*args, **kwargs)
                if square(out) or square(x):  # q @ k^T, scores @ v: 2 x out x the inner dimension
                    self.square_flops += 2 * out.numel() * x.shape[-1]
                return out
            elif func is F.multi_head_attention_forward:
                # one call (this mode is off inside it): (L, N, E) queries over (S, N, E) keys, its
                # weights written out where asked for (`need_weights`, nn.MultiheadAttention's default)
                key, heads = args[1], args[4]
                batch = x.shape[1] if x.ndim == 3 else 1
                self.mha_flops += 4 * batch * x.shape[0] * key.shape[0] * x.shape[-1]
                if kwargs.get("need_weights", args[15] if len(args) > 15 else True):
                    self.called.add(SCORES_SOFTMAX)
                    self.scores_bytes += batch * heads * x.shape[0] * key.shape[0] * x.element_size()
                else:
                    self.called.add(SDPA_NAME)
            if func is F.scaled_dot_product_attention:
                q, k, v = (*args, *(kwargs[n] for n in ("query", "key", "value")[len(args):]))[:3]
                b_h_sq = q.numel() // q.shape[-1]
                self.attention_flops += 2 * b_h_sq * k.shape[-2] * (q.shape[-1] + v.shape[-1])
                dropout = (kwargs or {}).get("dropout_p", args[4] if len(args) > 4 else 0.0)
                if dropout:
                    self.math_attention_bytes += MATH_ATTENTION_BYTES_PER_SCORE * b_h_sq * k.shape[-2]
                out = FlashLike.apply(q, k, v)
                if self.in_block:
                    self.block_kept += out.numel() * out.element_size() + 4 * b_h_sq
                return out
            return func(*args, **(kwargs or {}))

    return Mode()


class _Dispatched:
    """The aten ops dispatched while `mode` (a TorchDispatchMode, built on first use so that
    importing this module stays torch-free) is entered, and with `track_bytes` the live and peak
    bytes of the storages they create. Meta storages have sizes and are freed like real ones,
    so this measures backward's transient memory with no memory."""

    def __init__(self, *, track_bytes: bool) -> None:
        import weakref

        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        outer = self
        self.ops = self.live = self.peak = self.attention_flops = 0
        self.custom_ops: set[str] = set()  # "namespace::op" of a package's ops (plan.kernels)
        tracked: set[int] = set()
        # inside the first block (`in_block`): the bytes of the outputs selective checkpointing's
        # save list keeps (every second matmul, counted from the block's start, and the listed ops)
        self.in_block, self.block_kept, self.block_mms = False, 0, 0
        aten = torch.ops.aten
        matmuls = {getattr(aten, n).default for n in SELECTIVE_SAVED_MATMULS if hasattr(aten, n)}
        listed = {getattr(aten, n).default for n in SELECTIVE_SAVED_OPS if hasattr(aten, n)}
        kept: dict[int, Any] = {}  # the storages counted, held so that no freed one's key is reused

        def keep(out: Any) -> None:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in kept:
                    kept[t.untyped_storage()._cdata] = t.untyped_storage()
                    outer.block_kept += t.untyped_storage().nbytes()

        def free(key: int, nbytes: int) -> None:
            tracked.discard(key)
            outer.live -= nbytes

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                outer.ops += 1
                if func.namespace not in _TORCH_OP_NAMESPACES:
                    outer.custom_op(func.name(), args)
                out = func(*args, **(kwargs or {}))
                if outer.in_block and func in matmuls:
                    outer.block_mms += 1
                    if outer.block_mms % 2 == 1:
                        keep(out)
                elif outer.in_block and func in listed:
                    keep(out)
                for t in tree_flatten(out)[0] if track_bytes else ():
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

    def custom_op(self, name: str, args: Sequence[Any]) -> None:
        """Record a package's op; flash-attn's forward (q, k, v laid out batch, sequence, heads,
        head dim) adds its attention FLOPs, which FlopCounterMode does not know (its varlen
        form, packed sequences, is left uncounted)."""
        self.custom_ops.add(name)
        if name.startswith("flash_attn::") and name.endswith("forward") and len(args) >= 3:
            q, k, v = args[:3]
            if getattr(q, "ndim", 0) == 4:
                self.attention_flops += 2 * q.numel() // q.shape[-1] * k.shape[1] * (q.shape[-1] + v.shape[-1])


def _graph_functions(loss: Any) -> set[str]:
    """"module.Class" of each autograd Function in the graph behind `loss` (a fused loss or norm
    called as a Function, where no module of the model names it)."""
    out: set[str] = set()
    todo, done = [getattr(loss, "grad_fn", None)], set()
    while todo:
        node = todo.pop()
        if node is None or node in done:
            continue
        done.add(node)
        cls = getattr(node, "_forward_cls", None)  # a custom Function's node: its class
        if cls is not None:
            out.add(f"{cls.__module__}.{cls.__qualname__}")
        todo.extend(nxt for nxt, _ in node.next_functions)
    return out


def _backward_transient(loss: Any, params: Sequence[Any], tracker: _Dispatched) -> float:
    """The most bytes `loss.backward()` holds at once beyond what the forward left live,
    with each parameter's gradient dropped as it lands (the memory model counts gradients
    apart); 0 when backward does not run on the meta device (the model then counts none).
    `tracker` watched the forward, so the saved tensors backward frees are seen to go."""
    def drop(p: Any) -> None:
        p.grad = None

    hooks = [p.register_post_accumulate_grad_hook(drop) for p in params if p.requires_grad]
    tracker.peak = start = tracker.live
    try:
        with tracker.mode:
            loss.backward()
    except Exception as e:  # an op without a meta backward: the transient stays unmeasured
        log.debug("backward on the meta device failed (%s: %s); no backward transient", type(e).__name__, e)
        return 0.0
    finally:
        for h in hooks:
            h.remove()
    return float(tracker.peak - start)


def _pass(workload: Workload, model: Any, micro_batch: int, param_keys: set[int],
          first_block: Any = None, *, count_flops: bool = False, backward: bool = False,
          called: set[str] | None = None) -> tuple[int, int, tuple[float, ...], float]:
    """Bytes autograd saves for backward in one forward (each storage once, no parameters),
    the bytes of the first block's input (what checkpointing keeps per block), with
    `count_flops` the forward FLOPs (FlopCounterMode plus the attention it cannot see here;
    all, attention, convolutions), SDPA's math-path bytes beyond flash's and the aten ops the
    forward dispatched (else 0s), and with `backward` backward's transient bytes (else 0).
    With `count_flops`, the names of what the forward and loss called are added to `called`."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    block_in: list[int] = []
    sdpa = _flash_like_sdpa()
    # only backward's transient reads the bytes: the other passes skip their per-op bookkeeping
    # (a weakref finalizer per new storage), and the saved2 pass any dispatch mode at all
    dispatched = _Dispatched(track_bytes=backward) if count_flops or backward else None
    block_saved = 0

    def enter(module: Any, args: tuple[Any, ...]) -> None:
        block_in.append(sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor)))
        if count_flops and dispatched is not None and len(block_in) == 1:
            sdpa.in_block = dispatched.in_block = True

    def leave(module: Any, args: Any, out: Any) -> None:
        sdpa.in_block = False
        if dispatched is not None:
            dispatched.in_block = False

    handles = ([first_block.register_forward_pre_hook(enter), first_block.register_forward_hook(leave)]
               if first_block is not None else [])
    seen: set[int] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total, block_saved
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in seen and key not in param_keys:
            seen.add(key)
            total += storage.nbytes()
            block_saved += storage.nbytes() if sdpa.in_block else 0
        return t

    batch = meta_batch(workload, micro_batch)
    counter = FlopCounterMode(display=False) if count_flops else contextlib.nullcontext()
    try:
        with counter, dispatched.mode if dispatched else contextlib.nullcontext(), sdpa, \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = workload.loss_fn(model, batch)
    finally:
        for handle in handles:
            handle.remove()
    transient = _backward_transient(loss, list(model.parameters()), dispatched) if dispatched and backward else 0.0
    if count_flops and called is not None and dispatched is not None:
        called.update(sdpa.called, dispatched.custom_ops, _graph_functions(loss))
    del loss
    counted = (0.0,) * 9
    if isinstance(counter, FlopCounterMode) and dispatched is not None:
        by_op = counter.get_flop_counts().get("Global", {})
        conv = sum(n for op, n in by_op.items() if getattr(op, "__name__", str(op)).split(".")[0] in _CONV_OPS)
        unseen = float(sdpa.attention_flops + dispatched.attention_flops)  # by the kernels FlopCounterMode misses
        written = sdpa.mha_flops + (sdpa.square_flops if sdpa.scores_bytes else 0)
        counted = (float(counter.get_total_flops()) + unseen, unseen + written, float(conv),
                   float(sdpa.math_attention_bytes), float(dispatched.ops), float(block_saved),
                   float(dispatched.block_kept + sdpa.block_kept), float(sdpa.scores_bytes), float(sdpa.upcast_bytes))
    return total, (block_in[0] if block_in else 0), counted, transient


def measure(workload: Workload, model: Any, param_keys: set[int], first_block: Any, *,
            transients: bool = True, called: set[str] | None = None) -> Counts:
    """Saved bytes at micro-batch 1 and 2, the first block's input bytes, and the FLOPs and
    aten ops at 1; with `transients`, backward's transient at TRANSIENT_BATCHES (else 0: the
    two backward passes are a third of a profile's time, skipped where nobody reads them).
    What the forward and loss called is added to `called` (`_pass`)."""
    saved1, block_in, counted, _ = _pass(workload, model, PROFILE_BATCHES[0], param_keys, first_block,
                                         count_flops=True, called=called)
    flops, attention, conv, math_attention, ops, block_saved, block_selective, scores, upcast = counted
    saved2 = _pass(workload, model, PROFILE_BATCHES[1], param_keys)[0]
    transient1, transient2 = ((_pass(workload, model, mb, param_keys, backward=True)[3]
                               for mb in TRANSIENT_BATCHES) if transients else (0.0, 0.0))
    return Counts(saved1, saved2, block_in, flops, attention, conv, ops, math_attention,
                  block_saved, block_selective, scores, upcast, transient1, transient2)



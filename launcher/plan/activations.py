"""What backward keeps of one micro-batch: the saved activations (`activation_bytes`) and backward's
transient beyond them (`transient_bytes`), from the fp32 bytes the meta-device profile measured, each
kind of tensor at the dtype the run keeps it in (the factors below). Pure arithmetic on the frozen specs.

- activations: bf16 and fp16 scale `profile.activation_bytes_per_sample` by what each kind of op saves,
  under DDP's autocast and under FSDP's bf16 parameters, and torch.compile by what Inductor recomputes.
  On CPU, attention with dropout runs SDPA's math path: its probabilities and masks are added
  (`profile.math_attention_bytes_per_sample`); attention written out keeps its scores at the dtype its
  softmax ran in. Checkpointing (`checkpointing`, by mode) keeps each wrapped block's input and its
  mode's saved share (selective: matmul and attention outputs), the unwrapped blocks' activations, and
  what one wrapped block dropped while backward recomputes it.
- backward's transient: the most bytes backward holds at once beyond them (`profile.
  backward_transient_bytes_per_sample`, measured on meta: for a language model the loss gradient over
  the vocabulary, two logits-sized tensors), at the loss's dtype (AUTOCAST_TRANSIENT_FACTOR).
- a fused loss (`profile.loss_kernel`): flash-attn's CrossEntropyLoss saves its compute-dtype logits
  (not eager's fp32 log_softmax) and its backward makes one gradient like them: one such tensor saved
  outside the blocks and one as the transient.
"""
from __future__ import annotations

from launcher.plan.checkpointing import kept_activation_bytes
from launcher.specs import ModelProfile, Strategy

# Bytes of one element at the compute dtype of each precision.
COMPUTE_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

# Saved activations under bf16/fp16 relative to the fp32 measurement, by what autocast (DDP,
# runtime/harness.py) does to each kind of op: matmuls, convolutions and SDPA run in bf16 (their
# saved inputs are bf16 casts, their outputs bf16); the rest runs in its inputs' dtype.
# - A model with attention (a transformer): the residual stream starts at the fp32 embedding and
#   stays fp32 (fp32 + bf16 matmul output promotes), so the norms save fp32 inputs and fp32
#   outputs, and the next matmul saves a bf16 cast of each output besides. Per token and block
#   (Korthikanti et al. 2022, arXiv 2205.05198, s4.1 accounting, flash attention, width h, MLP f):
#   fp32 saves 4 x (8h + 2f) B; autocast 2 x 4h (norm inputs) + 2 x 6h (norm outputs fp32 + bf16)
#   + 2 x 4h (q, k, v, SDPA out) + 2 x 2f = 28h + 4f: 0.71 at f = 3h (gpt tiny), 0.69 at 4h (GPT-2),
#   0.72 at 2.69h (Llama). Measured on CPU (benchmarks/memory_truth.py): 0.72 for gpt tiny.
AUTOCAST_ACTIVATION_FACTOR = 0.7
# Checkpointed block inputs are that residual stream, fp32 under autocast: no discount.
AUTOCAST_BLOCK_INPUT_FACTOR = 1.0
# - Attention written out (`profile.attention_scores_bytes_per_sample`): CUDA's autocast runs softmax in fp32
#   (torch.amp's op list), kept for its backward beside the next matmul's bf16 cast: 4 + 2 B a score where fp32
#   keeps one 4-B tensor; CPU's runs it in bf16 (measured: its saved tensors), 2 B.
AUTOCAST_SCORES_FACTOR = {"cpu": 0.5, "cuda": 1.5}
# ... and a softmax asked for fp32 output and cast back (Hugging Face's eager attention:
# `softmax(dtype=torch.float32).to(query.dtype)`) keeps both on any device, whatever the regime.
UPCAST_SCORES_FACTOR = 1.5
# - A model without attention (conv nets, MLPs): everything after the first conv or matmul is
#   bf16 (batch norm and ReLU run in their bf16 input's dtype on CPU and CUDA autocast), block
#   inputs included: half the fp32 bytes. Measured on CPU: resnet 0.49 at micro-batch 16.
AUTOCAST_NO_ATTENTION_FACTOR = 0.5
# FSDP2 with MixedPrecisionPolicy(param_dtype=bf16) and no autocast (runtime/wrap.py): the
# parameters and the cast inputs are bf16, so every saved tensor, block inputs included, is too.
PARAM_DTYPE_ACTIVATION_FACTOR = 0.5
# ... except behind batch norm: the runtime keeps each BatchNorm an fp32 unit of its own that
# casts its input up (`cast_forward_inputs`), so a conv-BN-ReLU saves BN's fp32 input copy (4 B)
# and ReLU's bf16 output (2 B) where fp32 saves 4 + 4: 0.75. Measured on CPU: resnet 0.73.
PARAM_DTYPE_BATCH_NORM_FACTOR = 0.75

# torch.compile (Inductor's default min-cut partitioner, torch._functorch.partitioners) saves for
# backward what the compute-intensive ops (matmul, convolution, SDPA) need and recomputes
# pointwise work (norm outputs, activation functions, dropout masks from the RNG seed) in the
# fused backward kernels. A transformer block keeps its matmul outputs but drops those
# intermediates: FIT 0.75 of the eager saved bytes, measured on CPU live tensor bytes (torch 2.13,
# benchmarks/memory_truth.py): gpt tiny 0.80, HF GPT-2 tiny 0.70 of its profiled bytes. A conv
# net's saved tensors are all conv inputs and outputs (BN's input is the conv's output, ReLU's
# output the next conv's input): nothing to recompute, as eager (resnet measured 1.06).
COMPILE_SAVED_FACTOR = 0.75
COMPILE_NO_ATTENTION_FACTOR = 1.0

# Backward's transient under mixed precision relative to the fp32 measurement. Autocast runs
# cross_entropy / log_softmax / nll_loss in fp32 (torch.amp's fp32 op list), so of the two
# logits-sized gradients one stays fp32 and the one into the head's matmul is bf16: (4+2)/(4+4).
# Checked on one H100 (docs/benchmarks.md, GPU acceptance): gpt small, 64 x 1024 tokens, bf16
# DDP peaked at 60.9 GiB allocated against 39.4 GiB of tensors predicted without this term.
AUTOCAST_TRANSIENT_FACTOR = 0.75


def activation_factors(strategy: Strategy, profile: ModelProfile | None = None) -> tuple[float, float]:
    """(saved activations, checkpointed block inputs) relative to the fp32 measurement, by the
    precision and what the model is (`profile`: attention or not, batch norms; None: a
    transformer without batch norm)."""
    if strategy.precision == "fp32":
        return 1.0, 1.0
    attention = profile is None or profile.attention_flops_fwd_per_sample > 0
    if not strategy.shards_params:
        if attention:
            return AUTOCAST_ACTIVATION_FACTOR, AUTOCAST_BLOCK_INPUT_FACTOR
        return AUTOCAST_NO_ATTENTION_FACTOR, AUTOCAST_NO_ATTENTION_FACTOR
    if profile is not None and profile.batch_norms > 0:
        return PARAM_DTYPE_BATCH_NORM_FACTOR, PARAM_DTYPE_ACTIVATION_FACTOR
    return PARAM_DTYPE_ACTIVATION_FACTOR, PARAM_DTYPE_ACTIVATION_FACTOR


def compile_factor(profile: ModelProfile, strategy: Strategy) -> float:
    """Saved activations under torch.compile relative to eager (1 without compile)."""
    if not strategy.compile:
        return 1.0
    return COMPILE_SAVED_FACTOR if profile.attention_flops_fwd_per_sample > 0 else COMPILE_NO_ATTENTION_FACTOR


def logits_bytes(profile: ModelProfile) -> float:
    """One fp32 logits tensor per sample: half the profiled transient of a language model (the
    loss gradient, two logits-sized tensors); 0 for other models."""
    return profile.backward_transient_bytes_per_sample / 2 if profile.sample_units == "tokens" else 0.0


def fused_loss_bytes(profile: ModelProfile, strategy: Strategy) -> float:
    """Per sample, the compute-dtype logits a fused loss saves (its gradient is as many bytes);
    0 for an eager loss or a model without logits."""
    if profile.loss_kernel != "fused":
        return 0.0
    return logits_bytes(profile) * COMPUTE_DTYPE_BYTES[strategy.precision] / COMPUTE_DTYPE_BYTES["fp32"]


def scores_factors(strategy: Strategy, profile: ModelProfile, device: str) -> tuple[float, float]:
    """(plain, softmaxed into fp32) attention scores kept, relative to the fp32 measurement (AUTOCAST_SCORES_FACTOR)."""
    low = strategy.precision != "fp32"
    plain = AUTOCAST_SCORES_FACTOR["cpu" if device == "cpu" else "cuda"] if low and not strategy.shards_params else (
        activation_factors(strategy, profile)[0])
    return plain, UPCAST_SCORES_FACTOR if low else 1.0


def activation_bytes(profile: ModelProfile, strategy: Strategy, micro_batch: int, *, device: str = "") -> float:
    """Saved-for-backward bytes of one micro-batch, with the strategy's checkpointing mode. On `device`
    "cpu" attention with dropout runs SDPA's math path, saving `profile.math_attention_bytes_per_sample`
    more; not compiled (Inductor recomputes its softmax and mask: HF GPT-2 tiny measured below without it)."""
    factor, input_factor = activation_factors(strategy, profile)
    saved = profile.activation_bytes_per_sample
    if device == "cpu" and not strategy.compile:
        saved += profile.math_attention_bytes_per_sample
    loss = fused_loss_bytes(profile, strategy)
    if loss:  # the eager loss's fp32 log_softmax output is not saved; the fused loss's logits are
        saved -= min(logits_bytes(profile), saved)
    scores, upcast = profile.attention_scores_bytes_per_sample, profile.attention_scores_upcast_bytes_per_sample
    plain, upcast_factor = scores_factors(strategy, profile, device)
    kept = ((saved - scores) * factor + (scores - upcast) * plain + upcast * upcast_factor) * compile_factor(
        profile, strategy)
    if strategy.recomputes and profile.num_blocks >= 1:
        kept = kept_activation_bytes(strategy.checkpointing, saved_bytes=kept,
                                     block_input_bytes=profile.block_input_bytes_per_sample * input_factor,
                                     num_blocks=profile.num_blocks, selective_share=profile.selective_saved_share)
    return (kept + loss) * micro_batch


def transient_bytes(profile: ModelProfile, strategy: Strategy, micro_batch: int) -> float:
    """Backward's peak bytes beyond the saved activations, for one micro-batch."""
    if loss := fused_loss_bytes(profile, strategy):
        return loss * micro_batch
    factor = (1.0 if strategy.precision == "fp32" else PARAM_DTYPE_ACTIVATION_FACTOR
              if strategy.shards_params else AUTOCAST_TRANSIENT_FACTOR)
    return profile.backward_transient_bytes_per_sample * factor * micro_batch


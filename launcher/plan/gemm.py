"""What a GPU's matmuls cost by shape: the dtype's dense peak, the fraction of it a GEMM of a
given width and token count sustains, and the shapes a sequence model's profile implies (its
residual width, attention FLOPs, output head).

Pure arithmetic on the frozen specs (no torch, no I/O); `cost` prices whole steps with it and
`float8` its float8 GEMMs.
"""

from __future__ import annotations

import math

from launcher.hardware.types import DeviceSpec
from launcher.plan.activations import COMPUTE_DTYPE_BYTES, logits_bytes
from launcher.specs import ModelProfile

# Best bf16 GEMM a GPU sustains, as a fraction of its dense peak, by compute capability: the
# "maximum achievable matmul FLOPS" (MAMF) of stas00/ml-engineering, compute/accelerator/README.md:
# A100 SXM 267.9 of 312 TFLOP/s, H100 SXM 792.1 of 989 (CUDA 12.1). Other GPUs: the H100 figure.
# A100: FIT (see GEMM_HALF_WIDTH) between that measurement (0.859, a floor: llm-foundry's own A100
# tables report up to 0.79 of peak sustained over whole steps, HFU of MPT-13B at 1k tokens, which
# 0.859 x the time the rest takes cannot reach) and 0.93 (a cap: no published cuBLAS bf16 GEMM on
# an A100 above ~290 TFLOP/s); the fit sits between them (the history below).
GEMM_PEAK_FRACTION = {(8, 0): 0.90, (9, 0): 0.801}
GEMM_PEAK_FRACTION_DEFAULT = 0.80
# Small GEMMs run below MAMF (tile and wave quantization, NVIDIA's "Matrix Multiplication
# Background" guide): efficiency x w/(w + W) x t/(t + T) for width w and t tokens per micro-
# batch. Both from the measurement (docs/benchmarks.md, GPU kernel rates, one H100): a 768-wide
# block's GEMMs over 64k tokens at 0.60 of peak, 0.75 of MAMF: W = 768 (1/0.75 - 1) = 256 (768
# wide keeps 75% of MAMF, 8192 wide 97%); 2048-wide blocks at 2k tokens run 0.80 of their
# rate at 8k, 4096-wide 0.96: T = 100-750, taken as 512, the earlier fit's value (2048 tokens
# keep 80%, 16k 97%).
# FIT: the A100's GEMM_PEAK_FRACTION and ATTENTION_RUN_SCALE, jointly over the 80
# `fit` rows of benchmarks/published (`run.py`: a grid, least mean |log(predicted/published)|;
# among the points within 2% of the best, the one whose FA2 scale stays nearest 1, its kernel's
# own benchmark; Triton's curve is another kernel's: attention.ATTENTION_RUN_SCALE says why).
# CONTENTION, COMPILE_MEMORY_FACTOR, STEP_JITTER and SCALE_TAX kept from the earlier fit on the
# same rows (run.py's FIT_GRID says why). Refit after the run's loss, norm and head were priced
# from their code (FUSED_LOSS_PASSES, NORM_AUTOCAST_BYTES, the head as a wide GEMM) and
# MEMORY_PASSES was taken from its measurement: the A100's fraction 0.93 -> 0.90, Triton's scale
# 1.4 -> 1.2 (FA2's 0.9 unchanged); back to 0.93 once IBM's compiled 34B and 70B rows checkpoint
# every block, as their source's table says; 0.90 again once the rows reducing in bf16 are priced
# so (`reduce_dtype`); Triton's 1.2 -> 1.3 once attention's forward and backward got own rates.
# The 103 `check` rows (llm-foundry at 512-1k and 8k-64k tokens) are never fitted on; `run.py`
# reports them, and leave-one-source-out (each fit source refit without it).
GEMM_HALF_WIDTH = 256
GEMM_HALF_TOKENS = 512


def peak_flops(device: DeviceSpec, precision: str) -> float:
    """Dense peak FLOP/s for the precision's matmuls; fp32 stays fp32 (PyTorch leaves TF32 off
    for matmuls by default). A dtype the device does not list falls back to its fp32 peak."""
    return (device.peak_tflops.get(precision) or device.peak_tflops["fp32"]) * 1e12


def model_width(profile: ModelProfile) -> float | None:
    """The residual width of a sequence model (its first block's fp32 input per token / 4 B); None for others."""
    if profile.sample_units != "tokens" or profile.block_input_bytes_per_sample <= 0:
        return None
    return profile.block_input_bytes_per_sample / (4 * profile.units_per_sample)


def attention_flops_fwd(profile: ModelProfile) -> float:
    """Attention FLOPs per sample as the profile counts them (4 s^2 d per block, the causal mask
    ignored): measured where attention was seen, else (a profile from before that was counted, or
    attention the profile could not see) one self-attention of the residual width per block."""
    if profile.attention_flops_fwd_per_sample > 0:
        return profile.attention_flops_fwd_per_sample
    width = model_width(profile)
    if width is None:
        return 0.0
    s = profile.units_per_sample
    return min(4.0 * s * s * width * profile.num_blocks, 0.9 * profile.flops_fwd_per_sample)


def gemm_efficiency(device: DeviceSpec, width: float | None, tokens: float, precision: str = "bf16") -> float:
    """Fraction of the dense peak the matmuls of a micro-batch of `tokens` tokens run at.

    What a small GEMM loses (loading operand tiles, the epilogue, partial waves) costs in proportion
    to how fast its arithmetic is, so the half-saturation width and tokens scale with the precision's
    peak over bf16's: fp32 matmuls on CUDA cores (67 of 989 TFLOP/s on an H100) saturate at 1/15 the
    size. Measured on one H100 (docs/benchmarks.md, GPU acceptance run 3): GPT-2 small (768 wide) in
    fp32 stepped in 0.631 s against 0.94 s predicted with bf16's half-widths; the fp32 MAMF fraction
    is bf16's (an assumption)."""
    eff = GEMM_PEAK_FRACTION.get(device.compute_capability or (0, 0), GEMM_PEAK_FRACTION_DEFAULT)
    if width is not None:
        bf16 = device.peak_tflops.get("bf16") or device.peak_tflops["fp32"]
        scale = min(1.0, (device.peak_tflops.get(precision) or device.peak_tflops["fp32"]) / bf16)
        # an infinite width: a GEMM with no short side but its tokens (a language model's head)
        eff *= ((1.0 if math.isinf(width) else width / (width + GEMM_HALF_WIDTH * scale))
                * tokens / (tokens + GEMM_HALF_TOKENS * scale))
    return eff


def head_flops_fwd(profile: ModelProfile) -> float:
    """FLOPs per sample of a language model's output head (2 x width x vocab a token; `logits_bytes`); 0 for others."""
    width = model_width(profile)
    return 0.0 if width is None else 2.0 * width * logits_bytes(profile) / COMPUTE_DTYPE_BYTES["fp32"]

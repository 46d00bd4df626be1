"""Causal attention on a GPU, by kernel: the rate FlashAttention-2, Triton FlashAttention and PyTorch
SDPA reach at each sequence length on an architecture (ATTENTION_CURVES), a training run's attention
against its kernel's benchmark (ATTENTION_RUN_SCALE), backward against forward in FLOPs
(ATTENTION_BWD_FACTOR) and in rate (ATTENTION_FWD_OVER_BWD), which `cost.forward_pass` prices
attention FLOPs with; attention written out ("eager") is matmuls, priced as such (EAGER_HEAD_DIM).

Pure arithmetic: no torch, no I/O; never imports cli, backends, jobs, runtime, results or report.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from launcher.errors import PlanError
from launcher.hardware.types import DeviceSpec

# Causal attention forward+backward by kernel, head dim 128: TFLOP/s at each sequence length,
# FLOPs counted as the model counts them (the causal half of 4 s^2 d per block forward, 3.5x that
# forward+backward: the FlashAttention-2 benchmark's count), on the GPU whose dense bf16 peak
# (TFLOP/s) is given; other GPUs of the architecture scale by their peak, other architectures
# take the H100 curve. Between points: linear in log2(s); beyond the last: flat (each curve
# is flat by then); below the first: in proportion to s (a call's fixed cost over less work).
# The kernel is the run's, not the GPU's: the profile's `attention_kernel` (plan.kernels).
ATTENTION_SEQ = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


@dataclass(frozen=True, kw_only=True)
class AttentionCurve:
    """One kernel's causal forward+backward TFLOP/s at ATTENTION_SEQ[:len(tflops)] tokens, `peak_tflops` bf16."""

    tflops: tuple[float, ...]
    peak_tflops: float
    source: str

    def __post_init__(self) -> None:
        if not 2 <= len(self.tflops) <= len(ATTENTION_SEQ) or min(self.tflops) <= 0:
            raise PlanError(f"an attention curve needs 2-{len(ATTENTION_SEQ)} positive rates; got {self.tflops!r}")

    def fraction(self, seq_len: int) -> float:
        """The fraction of `peak_tflops` the kernel runs at for sequences of `seq_len`."""
        points = ATTENTION_SEQ[:len(self.tflops)]
        if seq_len <= points[0]:
            return self.tflops[0] * max(seq_len, 1) / points[0] / self.peak_tflops
        if seq_len >= points[-1]:
            return self.tflops[-1] / self.peak_tflops
        i = bisect.bisect_left(points, seq_len)  # points[i - 1] < seq_len <= points[i]
        t = math.log2(seq_len / points[i - 1]) / math.log2(points[i] / points[i - 1])
        return (self.tflops[i - 1] + t * (self.tflops[i] - self.tflops[i - 1])) / self.peak_tflops


_FA2_PAPER = ("FlashAttention-2 (Dao 2023, arXiv 2307.08691) attention forward+backward speed, "
              "with causal mask, head dimension 128")
# FlashAttention-2 (flash-attn 2.x, and PyTorch SDPA's flash backend, which is FA2's code from
# PyTorch 2.2): A100 80GB SXM4 Fig. 4(d); H100 80GB SXM5 the paper's H100 figure (d) (also
# assets/flash2_{a100,h100}_fwd_bwd_benchmark.png of Dao-AILab/flash-attention).
# Triton FlashAttention (the paper's "Triton", OpenAI's triton.ops.flash_attention; llm-foundry
# runs flash_attn_triton.py: ATTENTION_RUN_SCALE): A100 the same Fig. 4(d). No H100 measurement
# exists: the kernel emits Ampere mma.sync, as FA1 and FA2 do, and those gain 1.57-1.78x from
# A100 to H100 at each length (FA1: 98/55, 109/62, 108/69, 126/76, 135/80, 137/83 in the two
# figures); so the A100 Triton curve x FA1's ratio at each length (an assumption, labelled).
# SDPA: PyTorch SDPA as dlaunch's workloads run it: on an H100 measured (docs/benchmarks.md, GPU
# kernel rates: torch 2.11, 0.15-0.59 of peak at 512-64k tokens); on an A100 the flash backend
# (FA2's curve).
ATTENTION_CURVES: dict[str, dict[tuple[int, int], AttentionCurve]] = {
    "fa2": {(8, 0): AttentionCurve(tflops=(99, 133, 155, 173, 182, 189), peak_tflops=312,
                                   source=f"{_FA2_PAPER}, A100 (Fig. 4d)"),
            (9, 0): AttentionCurve(tflops=(163, 221, 265, 294, 308, 328), peak_tflops=989,
                                   source=f"{_FA2_PAPER}, H100 figure (d)")},
    "triton-fa": {(8, 0): AttentionCurve(tflops=(50, 61, 68, 74, 78, 80), peak_tflops=312,
                                         source=f"{_FA2_PAPER}, A100 (Fig. 4d), Triton"),
                  (9, 0): AttentionCurve(tflops=(89, 107, 106, 123, 132, 132), peak_tflops=989,
                                         source="A100 Triton x FA1's H100/A100 ratio (assumed)")},
    "sdpa": {(8, 0): AttentionCurve(tflops=(99, 133, 155, 173, 182, 189), peak_tflops=312,
                                    source=f"{_FA2_PAPER}, A100 (Fig. 4d): SDPA's flash backend"),
             (9, 0): AttentionCurve(tflops=(148, 247, 366, 465, 534, 554, 564, 584), peak_tflops=989,
                                    source="measured, docs/benchmarks.md (torch 2.11, H100 SXM)")},
}
ATTENTION_CURVE_DEFAULT_ARCH = (9, 0)
# A training run's attention against its kernel's benchmark curve, which times one call of 16 heads
# over 16k tokens (FA2) or 64k tokens (dlaunch's SDPA measurement): a model's calls differ in heads x
# batch, head dim and what runs around them. FIT (see gemm.GEMM_HALF_WIDTH) on the `fit` rows of
# benchmarks/published that ran each kernel (Triton: llm-foundry at 2k-8k tokens; FA2: torchtitan,
# IBM, llm-foundry's large-scale table); SDPA: 1, its curve is dlaunch's own call measured. FA2's
# is drawn towards 1 (its curve is the runs' kernel); Triton's curve is OpenAI's kernel, not the
# flash_attn_triton.py llm-foundry runs, so it takes the fit rows' least error, which barely
# tells 1.0 from 1.4; that pull was dropped after the 16k-64k check rows read 15% slow at 1.0
# (for this constant they are not wholly out of sample: docs/benchmarks.md).
ATTENTION_RUN_SCALE = {"fa2": 0.9, "triton-fa": 1.3, "sdpa": 1.0}
# Backward of flash attention: 5 matmuls against the forward's 2 (FA2 paper, section 3).
ATTENTION_BWD_FACTOR = 2.5
# The forward's rate over the backward's (FLOPs as above), which the curves average: a recomputed
# forward runs at the forward's. Triton: 1.7 (Triton's fused-attention tutorial, the FA2 paper's
# "Triton" kernel, causal, 1k-16k tokens: 87/49 ... 145/84 TFLOP/s in triton-lang/triton PR 1917).
# FA2: 1.1 (its paper: forward up to 73% of peak, backward 63%; flash-attention's
# benchmark_flash_attention.py prints 1.01-1.06 at 2k-8k). SDPA: its flash backend is FA2's code
# (assumed on an H100, where dlaunch measured forward+backward together).
ATTENTION_FWD_OVER_BWD = {"fa2": 1.1, "triton-fa": 1.7, "sdpa": 1.1}
# Attention written out (q @ k^T, mask, softmax, @ v: Hugging Face's "eager", nanoGPT's slow path,
# nn.MultiheadAttention with its weights) runs no attention kernel: two matmuls over the whole s x s
# (the causal mask applied after: twice flash's FLOPs), backward two for each (2x), batched GEMMs
# whose short side is the head dim (`gemm.gemm_efficiency` at the curves' head dim, an assumption);
# mask, softmax and dropout are memory-bound work over the scores the profile saw the model save.
# Checked: on an A100 at 2k tokens 6x flash's time, inside the 3-10x the FA2 paper measured against
# PyTorch's standard attention (arXiv 2307.08691, section 4.1).
EAGER_HEAD_DIM = 128


def forward_share(kernel: str) -> float:
    """The forward's share of attention's seconds with `kernel`: F/Rf of F/Rf + 2.5F/Rb = 1/(1 + 2.5 r)."""
    return 1.0 / (1.0 + ATTENTION_BWD_FACTOR * ATTENTION_FWD_OVER_BWD[kernel])


def attention_efficiency(device: DeviceSpec, seq_len: int, kernel: str = "sdpa") -> float:
    """Fraction of the dense peak causal attention runs at (forward+backward) for sequences of
    `seq_len` with attention `kernel` (ATTENTION_CURVES; a ModelProfile's `attention_kernel`)."""
    curves = ATTENTION_CURVES[kernel]
    curve = curves.get(device.compute_capability or (0, 0), curves[ATTENTION_CURVE_DEFAULT_ARCH])
    return curve.fraction(seq_len) * ATTENTION_RUN_SCALE[kernel]

"""Measured rates of the kernels the GPU step-time model prices, beside the model's.

    python benchmarks/gpu_kernel_rates.py [--json OUT]     (on a CUDA machine)

The cost model (`launcher/plan/cost.py`) prices a transformer step as matmuls at a rate that
grows with the GEMM's width and tokens, causal flash attention at a rate that grows with the
sequence length, and memory-bound work over the HBM bandwidth. This times each on the GPU it runs
on, with CUDA events over repeated calls after a warm-up:

- matmuls: the four GEMMs of a transformer block (QKV, attention out, MLP up and down) of width
  w over t tokens, bf16, forward + backward (3x the forward FLOPs), for w in 768..8192 and t in
  2k..64k tokens; reported as a fraction of the dense bf16 peak, beside `gemm_efficiency`;
- attention: `scaled_dot_product_attention`, causal, bf16, head dim 128, forward + backward,
  64k tokens per call split into sequences of 512..64k; FLOPs counted as the model counts them
  (4 s^2 d per head and sequence forward, half of it for the causal mask, backward 2.5x);
  beside `attention_efficiency`;
- memory-bound: a LayerNorm + GELU + residual chain over a 64k x w activation, bytes moved per
  second against the HBM figure.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def timed(fn: Any, *, repeats: int = 10) -> float:
    """Median seconds of one call of `fn` on the GPU (CUDA events, after two warm-up calls)."""
    import torch

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def gemm_rows(peak: float, device: Any) -> list[dict[str, Any]]:
    """Block GEMMs forward + backward at several widths and token counts."""
    import torch

    from launcher.plan.cost import gemm_efficiency

    rows = []
    for width in (768, 1024, 2048, 4096, 8192):
        for tokens in (2048, 8192, 65536):
            shapes = [(width, 3 * width), (width, width), (width, 4 * width), (4 * width, width)]
            inputs = {k: torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                      for k in (width, 4 * width)}
            weights = [torch.randn(k, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for k, n in shapes]

            def block() -> None:
                # each GEMM's backward is two more of the same size: grad of input and weight
                outs = [inputs[k] @ w for (k, _n), w in zip(shapes, weights)]
                torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

            seconds = timed(block)
            flops = 3 * 2 * tokens * sum(k * n for k, n in shapes)
            rows.append({"width": width, "tokens": tokens, "s": seconds,
                         "fraction_of_peak": flops / seconds / peak,
                         "model_fraction": gemm_efficiency(device, width, tokens, "bf16")})
            torch.cuda.empty_cache()
    return rows


def attention_rows(peak: float, device: Any) -> list[dict[str, Any]]:
    """Causal SDPA forward + backward, 64k tokens a call, by sequence length."""
    import torch
    import torch.nn.functional as F

    from launcher.plan.attention import ATTENTION_BWD_FACTOR, attention_efficiency

    rows = []
    heads, dim, total = 16, 128, 65536
    for seq in (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536):
        batch = total // seq
        q, k, v = (torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))

        def attn() -> None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(torch.ones_like(out))

        seconds = timed(attn, repeats=5)
        fwd = 0.5 * 4 * seq * seq * dim * heads * batch  # causal: half, as the model counts
        flops = fwd * (1 + ATTENTION_BWD_FACTOR)
        rows.append({"seq": seq, "batch": batch, "s": seconds, "fraction_of_peak": flops / seconds / peak,
                     "model_fraction": attention_efficiency(device, seq)})
        torch.cuda.empty_cache()
    return rows


def memory_rows(device: Any) -> list[dict[str, Any]]:
    """LayerNorm + GELU + residual add over 64k tokens, forward: bytes moved per second."""
    import torch
    import torch.nn.functional as F

    from launcher.plan.hbm import hbm_bytes_per_s

    rows = []
    for width in (768, 4096):
        x = torch.randn(65536, width, device="cuda", dtype=torch.bfloat16)
        res = torch.randn_like(x)

        def chain() -> None:
            h = F.layer_norm(x, (width,))
            h = F.gelu(h)
            _ = h + res

        seconds = timed(chain)
        # layer norm reads x, writes h; gelu reads h, writes h; add reads h and res, writes out
        moved = 7 * x.numel() * x.element_size()
        rows.append({"width": width, "s": seconds, "bytes_per_s": moved / seconds,
                     "hbm_fraction": moved / seconds / hbm_bytes_per_s(device)})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_kernel_rates: needs a CUDA GPU; none is visible here", file=sys.stderr)
        return 2
    from launcher.hardware.detect import detect_topology

    device = detect_topology().accelerator
    peak = device.peak_tflops["bf16"] * 1e12
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "gemm": gemm_rows(peak, device), "attention": attention_rows(peak, device),
           "memory": memory_rows(device)}
    print(f"{out['device']}, torch {out['torch']}, bf16 peak {peak / 1e12:.0f} TFLOP/s")
    print("block GEMMs fwd+bwd: width tokens  measured/peak  model/peak")
    for r in out["gemm"]:
        print(f"  {r['width']:5d} {r['tokens']:6d}  {r['fraction_of_peak']:.3f}  {r['model_fraction']:.3f}")
    print("causal SDPA fwd+bwd, 64k tokens: seq  measured/peak  model/peak")
    for r in out["attention"]:
        print(f"  {r['seq']:6d}  {r['fraction_of_peak']:.3f}  {r['model_fraction']:.3f}")
    print("layer norm + gelu + add: width  GB/s  of HBM")
    for r in out["memory"]:
        print(f"  {r['width']:5d}  {r['bytes_per_s'] / 1e9:.0f}  {r['hbm_fraction']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

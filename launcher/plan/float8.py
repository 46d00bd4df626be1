"""Float8 training's price on a GPU (strategy field `float8`): which matmuls convert, how fast they
run, and what their casts cost.

- Float8 tensor cores run at twice bf16's dense rate from compute capability 8.9 (datasheets,
  dense: H100 SXM 1,979 against 989 TFLOP/s, L40S 733 against 362, B200 4.5 against 2.25
  PFLOP/s); below 8.9 there are none, and the plan never proposes float8.
- A float8 GEMM reaches FLOAT8_GEMM_FRACTION of the share of its peak a bf16 GEMM of its shape
  reaches (`gemm.gemm_efficiency`).
- Dynamic scaling reads each operand for its amax, then casts it, and backward transposes the
  float8 copies: FLOAT8_CAST_BYTES of HBM traffic per element of each converted layer's input,
  weight and output gradient, per micro-batch (fused by torch.compile as other memory-bound work).
- The layers that convert are those torchao's filter keeps (`passes`, as `launcher.runtime.float8`
  applies it), never the output head; attention and the memory-bound work stay bf16.
- Under FSDP with tensorwise scaling the runtime all-gathers the converted weights in float8
  (torchao's `enable_fsdp_float8_all_gather`): 1 B a parameter instead of the compute dtype's, after
  a latency-bound all-reduce of each converted weight's amax (torchao's `reduce_amax`: the runtime
  precomputes no scales; `fsdp_float8_gather`).
Both constants are fit to torchao's microbenchmark of one Float8Linear's forward and backward on
an H100 against bf16 (pytorch/ao, torchao/float8/README.md, "Performance"): 0.80x at M, K, N =
1024, 2048, 1024 and 1.39x at 4096, 8192, 16384, which the model gives as 0.82x and 1.36x. Whole
steps are checked, never fitted, against torchtitan's published float8/bf16 pairs
(benchmarks/published).

Pure arithmetic on the frozen specs (no torch, no I/O).
"""

from __future__ import annotations

from launcher.hardware.types import DeviceSpec
from launcher.plan.gemm import model_width
from launcher.specs import ModelProfile, Strategy

FLOAT8_MIN_CC = (8, 9)
FLOAT8_PEAK_OVER_BF16 = 2.0
FLOAT8_GEMM_FRACTION = 0.85
FLOAT8_CAST_BYTES = 7.0
# a transformer block's linears as (in, out) in units of the width, and each one's share of the
# block's matmul FLOPs: q, k, v, o (d x d) and the MLP's up and down projections (d x 4d)
_BLOCK = ((1, 1, 1 / 12), (1, 1, 1 / 12), (1, 1, 1 / 12), (1, 1, 1 / 12), (1, 4, 4 / 12), (4, 1, 4 / 12))
# the inputs and outputs of a block's linears per token, summed, over the block's parameters /
# width: 1.5 for that block (18 d over 12 d^2), as for Llama 3 8B's (GQA, SwiGLU at 3.5x:
# 81,920 over 218M / 4,096)
LINEAR_ELEMENTS_PER_PARAM = sum(k + n for k, n, _ in _BLOCK) / sum(k * n for k, n, _ in _BLOCK)


def supported(device: DeviceSpec) -> bool:
    """Whether the GPU has float8 tensor cores (compute capability >= 8.9)."""
    return device.compute_capability is not None and device.compute_capability >= FLOAT8_MIN_CC


def passes(recipe: str, k: float, n: float) -> bool:
    """torchao's filter for a linear of `k` inputs and `n` outputs (float8_linear_utils,
    `_auto_filter_for_recipe`, from its H100 benchmarks): multiples of 16, large enough to gain."""
    if k % 16 or n % 16:
        return False
    if recipe == "rowwise":
        return not (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048))
    return not (k <= 4096 and n <= 1024)


def converted_share(profile: ModelProfile, recipe: str, tp: int = 1) -> float:
    """Share of the blocks' matmul FLOPs that run in float8: the linears of a transformer block of the
    profile's width (split `tp` ways) that pass the recipe's filter; 0 for other than sequence models."""
    width = model_width(profile)
    if width is None or recipe == "none":
        return 0.0
    return sum(_converted(width / tp, recipe))


def _converted(d: float, recipe: str) -> list[float]:
    """The FLOP shares of the block linears at width `d` that pass the recipe's filter."""
    return [share for k, n, share in _BLOCK if passes(recipe, round(k * d), round(n * d))]


def fsdp_float8_gather(profile: ModelProfile, strategy: Strategy, device: DeviceSpec) -> tuple[float, int]:
    """(parameters of one TP slice FSDP all-gathers in float8, converted weights per block: one amax
    all-reduce each): tensorwise float8 under FSDP with float8 tensor cores; (0, 0) otherwise."""
    width = model_width(profile)
    if strategy.float8 != "tensorwise" or not strategy.shards_params or not supported(device) or width is None:
        return 0.0, 0
    shares = _converted(width / strategy.tp, "tensorwise")
    return sum(shares) * profile.num_blocks * profile.largest_block_params / strategy.tp, len(shares)


def float8_terms(profile: ModelProfile, strategy: Strategy, micro_batch: int,
                 device: DeviceSpec) -> tuple[float, float]:
    """(share of the blocks' matmul FLOPs converted, HBM bytes of the casts in one micro-batch's
    forward: a third of forward and backward's, as backward is priced at twice the forward's
    memory-bound work). (0, 0) without float8 or without float8 tensor cores."""
    if strategy.float8 == "none" or not supported(device):
        return 0.0, 0.0
    share = converted_share(profile, strategy.float8, strategy.tp)
    width = model_width(profile)
    if not share or width is None:
        return 0.0, 0.0
    params = share * profile.num_blocks * profile.largest_block_params
    elements = micro_batch * profile.units_per_sample * LINEAR_ELEMENTS_PER_PARAM * params / width + params
    return share, FLOAT8_CAST_BYTES * elements / 3


def gemm_speedup() -> float:
    """A converted GEMM's rate over bf16's at the same shape."""
    return FLOAT8_PEAK_OVER_BF16 * FLOAT8_GEMM_FRACTION

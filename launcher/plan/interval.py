"""How far a predicted step time may be off: an 80% interval from the model's own validation.

For each regime the residual is measured / predicted step time (for the GPU model: predicted /
published tokens/s per GPU, the same ratio), and the interval is the prediction times the 10th and
90th percentiles of those residuals: "0.42 s (0.36-0.49 s, 80%)". Regimes and their validation:
- GPU, by sequence band (<= 1k, 2k-4k, 8k, 16k+ tokens): the published runs of benchmarks/published
  (`run.py --intervals` prints this table from the current model). A band with too few rows, and a
  model that is not a sequence model, take every row's ratios (GPU_FALLBACK); the basis says which.
- Beyond MAX_PUBLISHED_GPUS the interval widens by SCALE_WIDEN per doubling: no run of that size
  checked the model (an assumption, labelled).
- CPU: the grid of benchmarks/cpu_truth.py (1-4 ranks, mlp / gpt / ResNet, fp32 and bf16).

Pure: no torch, no I/O; never imports cli, backends, jobs, runtime, results or report.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from launcher.errors import PlanError
from launcher.plan.types import StepInterval

COVERAGE = 0.8


@dataclass(frozen=True, kw_only=True)
class Residuals:
    """The 10th and 90th percentiles of measured / predicted over one regime's validation."""

    low_ratio: float
    high_ratio: float
    rows: int
    basis: str

    def __post_init__(self) -> None:
        if not 0 < self.low_ratio <= self.high_ratio or self.rows < 1:
            raise PlanError(f"residuals need 0 < low <= high and rows >= 1; got "
                            f"{self.low_ratio!r}, {self.high_ratio!r}, {self.rows!r}")


# FROM: benchmarks/published/run.py --intervals: per band, the 10th / 90th percentile of
# measured / predicted step time (= predicted / published tokens/s per GPU) over the 80 `fit`
# rows of benchmarks/published/results.yaml, each predicted out of sample (by the FIT constants
# refit without its source: leave-one-source-out). The `check` rows are never used here: <= 1k
# and 16k+ have no fit rows and take the fallback; run.py prints how often all rows, and the
# check rows alone, fall inside.
GPU_RESIDUALS: dict[str, Residuals] = {
    "2k-4k": Residuals(low_ratio=0.933, high_ratio=1.138, rows=69,
                       basis="69 published GPU runs at 2k-4k tokens, out of sample"),
    "8k": Residuals(low_ratio=0.881, high_ratio=1.068, rows=11,
                    basis="11 published GPU runs at 8k tokens, out of sample"),
}
GPU_FALLBACK = Residuals(low_ratio=0.915, high_ratio=1.137, rows=80,
                         basis="80 published GPU runs, all lengths, out of sample")
# Fewer rows than this in a band and its percentiles are noise: the fallback is used instead.
MIN_BAND_ROWS = 8
# FROM: benchmarks/cpu_truth.py (measured / predicted step time per cell, see docs/benchmarks.md).
CPU_RESIDUALS = Residuals(low_ratio=0.85, high_ratio=1.15, rows=72,
                          basis="two runs of the 36-cell CPU grid (benchmarks/cpu_truth.py: 1-4 "
                                "ranks, mlp, gpt, ResNet; AMD EPYC, 2026-11-27)")
# The largest data-parallel job among the published runs.
MAX_PUBLISHED_GPUS = 512
# Each doubling beyond it widens the interval by this share on either side (an assumption: the
# published series lose 2-5% per doubling from 128 to 512 GPUs, and nothing checks beyond).
SCALE_WIDEN = 0.05


def seq_band(seq_len: int | None) -> str:
    """The published-run band a sequence length falls in ("other": not a sequence model)."""
    if seq_len is None:
        return "other"
    return next((band for limit, band in ((1024, "<=1k"), (4096, "2k-4k"), (8192, "8k")) if seq_len <= limit), "16k+")


def residuals_for(*, on_gpu: bool, seq_len: int | None) -> Residuals:
    """The validation residuals of the regime a prediction falls in."""
    if not on_gpu:
        return CPU_RESIDUALS
    band = GPU_RESIDUALS.get(seq_band(seq_len))
    return band if band is not None and band.rows >= MIN_BAND_ROWS else GPU_FALLBACK


def step_interval(step_time_s: float, *, on_gpu: bool, seq_len: int | None, world_size: int = 1,
                  kernel_spread: tuple[float, float, str] = (1.0, 1.0, "")) -> StepInterval:
    """The 80% interval around `step_time_s` for a plan on GPUs (`on_gpu`) or CPUs. The residuals come
    from runs whose kernels were known, so a kernel the plan assumed widens it by how far the others
    it could be move the step time (`kernel_spread`: (low, high, note) of `kernels.assumed_spread`, and of the
    host's launches where they set the step: `cost.HOST_OP_RANGE_S`)."""
    if not step_time_s > 0 or not math.isfinite(step_time_s):
        raise PlanError(f"a step time must be positive and finite; got {step_time_s!r}")
    if not 0 < kernel_spread[0] <= 1 <= kernel_spread[1]:
        raise PlanError(f"a kernel spread needs 0 < low <= 1 <= high; got {kernel_spread[:2]!r}")
    res = residuals_for(on_gpu=on_gpu, seq_len=seq_len)
    low, high, basis = res.low_ratio, res.high_ratio, res.basis
    if on_gpu and world_size > MAX_PUBLISHED_GPUS:
        widen = min(0.5, SCALE_WIDEN * math.log2(world_size / MAX_PUBLISHED_GPUS))
        low, high = low * (1 - widen), high * (1 + widen)
        basis += f"; widened {widen:.0%} each side beyond {MAX_PUBLISHED_GPUS} GPUs (assumed)"
    if kernel_spread[2]:
        low, high = low * kernel_spread[0], high * kernel_spread[1]
        basis += f"; widened for what was assumed: {kernel_spread[2]}"
    return StepInterval(step_time_s=step_time_s, low_s=step_time_s * low, high_s=step_time_s * high,
                        coverage=COVERAGE, basis=basis)


__all__ = ["COVERAGE", "Residuals", "GPU_RESIDUALS", "GPU_FALLBACK", "CPU_RESIDUALS", "MIN_BAND_ROWS",
           "MAX_PUBLISHED_GPUS", "SCALE_WIDEN", "seq_band", "StepInterval", "residuals_for", "step_interval"]

"""What each activation checkpointing mode recomputes and keeps: one frozen table, and the two prices
the planner takes from it (backward's recomputed share of the forward, the activation bytes kept).

The modes (`launcher.specs.CHECKPOINTING`; `launcher.runtime.wrap` applies them to the
workload's repeated blocks, `blocks(model)`):
- none: every op keeps what its backward needs.
- selective: torchtitan's per-op policy (pytorch/torchtitan, `_apply_op_sac` in
  torchtitan/distributed/activation_checkpoint.py and `_save_list` / `_custom_policy` in
  torchtitan/models/llama3/infra/parallelize.py): every block runs under a selective-checkpoint
  context (torch.utils.checkpoint.create_selective_checkpoint_contexts) that saves the outputs
  of SDPA, reduce-scatter, max and the matmuls but every second one, and recomputes the rest.
- every-other: whole-block checkpointing of blocks 2, 4, ... (torchtitan's per-layer selective,
  `selective_ac_option = "2"`: `_layer_sac_count % ac_freq == 0`); floor(n / 2) of n blocks.
- full: whole-block checkpointing of every block.

Per mode the table says which share of each kind of forward work backward runs again (matmul,
attention, memory-bound: the split `cost.ForwardPass` and `cpu_cost.CpuForward` make) and which
share of a checkpointed block's saved activations stays saved anyway. The modes recompute nothing
outside the blocks (embeddings, head, loss), which the forward's parts do not separate: this
overprices recompute by their share, small for large models but not for tiny ones (gpt tiny on
CPU, one thread, time per forward+backward over `none`: full +0.65, every-other +0.32, selective
+0.57 of a forward, priced 1.0, 0.5, 0.55; docs/benchmarks.md, "Checkpointing modes on CPU").

Pure: no torch, no I/O; never imports cli, backends, jobs, runtime, results or report.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from launcher.errors import PlanError
from launcher.specs import CHECKPOINTING, check


@dataclass(frozen=True, kw_only=True)
class CheckpointingMode:
    """What one mode recomputes in backward and keeps from forward, per block it wraps."""

    name: str
    whole_blocks: bool  # checkpoint_wrapper recomputes whole blocks (else per op, or nothing)
    every_nth_block: int  # 1: every block, 2: every second, 0: none
    # shares of a wrapped block's forward work that backward recomputes, by kind
    matmul_recomputed: float
    attention_recomputed: float
    memory_bound_recomputed: float
    # share of a wrapped block's saved-for-backward bytes kept anyway (besides its input)
    saved_share: float

    def __post_init__(self) -> None:
        check(self.name in CHECKPOINTING, PlanError, f"unknown checkpointing mode {self.name!r}")
        check(self.every_nth_block >= 0, PlanError, "every_nth_block must be >= 0")
        for v in (self.matmul_recomputed, self.attention_recomputed, self.memory_bound_recomputed, self.saved_share):
            check(0.0 <= v <= 1.0, PlanError, f"checkpointing mode {self.name}: shares in [0, 1]")

    def wrapped_blocks(self, num_blocks: int) -> int:
        """Blocks this mode wraps of `num_blocks`: all, floor(n / 2) (blocks 2, 4, ...), none."""
        return num_blocks // self.every_nth_block if self.every_nth_block else 0


# Selective's shares. The policy recomputes every second `mm` of a block (torchtitan:
# `meta["forward_mm_count"] % 2 == 0` recomputes; the odd ones are saved): half of them by count,
# by FLOPs (h = width, f = MLP width, in h^2 units of a block's matmuls) wk, wo, w3 of wq wk wv
# wo w1 w3 w2 in a Llama block: 2 + f/h of 4 + 3f/h, 0.39 at f = 2.69h (Llama 2 7B), 0.37 with
# Llama 3 8B's GQA and f = 3.5h; wk, wo, w2 of a GELU block: 0.5. Llama's shape is the default of
# workloads/gpt.py and of most published runs.
SELECTIVE_MATMUL_RECOMPUTED = 0.4
# SDPA's outputs are saved (flash / efficient / cuDNN / CPU flash ops in the save list): nothing
# of attention itself is recomputed.
SELECTIVE_ATTENTION_RECOMPUTED = 0.0
# Norms, activation functions, rotary, residual adds, casts: none is in the save list.
SELECTIVE_MEMORY_BOUND_RECOMPUTED = 1.0
# What stays saved: in tokens x h units of one block's saved tensors (the accounting of
# Korthikanti et al. 2022, arXiv 2205.05198, section 4.1, without dropout and with flash
# attention: no s^2 terms), a Llama block (RMSNorm, SwiGLU) saves 8h + 4f (norm inputs and
# outputs 4h; q, k, v and SDPA's output 4h; the MLP's four f-wide tensors), of which the policy
# keeps q, v, w1's and w2's outputs (saved mms) and SDPA's output: 4h + f, 0.36 at f = 2.69h; a
# GELU block (LayerNorm, biases: workloads/gpt.py's MPT style) saves 8h + 2f and keeps q, v, w1's
# and SDPA's outputs: 3h + f, 0.43 at f = 3h. Measured on CPU (torch 2.13, the forward's
# surviving allocations of gpt tiny; docs/benchmarks.md, "Checkpointing modes on CPU"): 0.21
# of a Llama-style block (its rotary tables, recomputed, make the block larger than the
# accounting) and 0.38 of a GELU one; 0.4 errs towards the larger plan (it fits where predicted
# to). A profile measures its own (`ModelProfile.selective_saved_share`: the save list's outputs
# over the first block's saved bytes; gpt tiny 0.30, its MPT style 0.40, Llama 2 13B's shape
# 0.31, Llama 2 70B's (grouped KV heads) 0.26); this is the share of a profile from before that
# was measured.
SELECTIVE_SAVED_SHARE = 0.4

MODES: Mapping[str, CheckpointingMode] = MappingProxyType({
    "none": CheckpointingMode(name="none", whole_blocks=False, every_nth_block=0, matmul_recomputed=0.0,
                              attention_recomputed=0.0, memory_bound_recomputed=0.0, saved_share=1.0),
    "selective": CheckpointingMode(name="selective", whole_blocks=False, every_nth_block=1,
                                   matmul_recomputed=SELECTIVE_MATMUL_RECOMPUTED, saved_share=SELECTIVE_SAVED_SHARE,
                                   attention_recomputed=SELECTIVE_ATTENTION_RECOMPUTED,
                                   memory_bound_recomputed=SELECTIVE_MEMORY_BOUND_RECOMPUTED),
    # a whole-block mode recomputes all of each block it wraps and keeps only its input
    "every-other": CheckpointingMode(name="every-other", whole_blocks=True, every_nth_block=2, matmul_recomputed=1.0,
                                     attention_recomputed=1.0, memory_bound_recomputed=1.0, saved_share=0.0),
    "full": CheckpointingMode(name="full", whole_blocks=True, every_nth_block=1, matmul_recomputed=1.0,
                              attention_recomputed=1.0, memory_bound_recomputed=1.0, saved_share=0.0),
})
# Short names for plan labels ("FSDP full bf16 + ckpt")
LABELS: Mapping[str, str] = MappingProxyType(
    {"none": "", "selective": "sel-ckpt", "every-other": "ckpt/2", "full": "ckpt"})


def mode_of(name: str) -> CheckpointingMode:
    """The table's row for `name`; PlanError naming the modes for anything else."""
    check(name in MODES, PlanError, f"unknown checkpointing mode {name!r}; use one of {', '.join(CHECKPOINTING)}")
    return MODES[name]


def recompute_share(name: str, *, num_blocks: int, matmul_s: float, attention_s: float, memory_bound_s: float) -> float:
    """Share of one forward's seconds that backward runs again under mode `name`, from the forward's
    split by kind of work; 0 for a profile without blocks (nothing to wrap)."""
    mode = mode_of(name)
    wrapped = mode.wrapped_blocks(num_blocks)
    total = matmul_s + attention_s + memory_bound_s
    if wrapped == 0 or total <= 0:
        return 0.0
    again = (mode.matmul_recomputed * matmul_s + mode.attention_recomputed * attention_s
             + mode.memory_bound_recomputed * memory_bound_s)
    return again / total * wrapped / num_blocks


def kept_activation_bytes(name: str, *, saved_bytes: float, block_input_bytes: float, num_blocks: int,
                          selective_share: float | None = None) -> float:
    """Bytes of one micro-batch's activations alive at backward's peak under mode `name`, of the forward's
    `saved_bytes` without checkpointing (counted as the blocks', evenly): a wrapped block keeps its input
    and its mode's `saved_share` (selective: `selective_share`, the profile's measurement, where given);
    backward brings back what one wrapped block dropped as it recomputes."""
    mode = mode_of(name)
    wrapped = mode.wrapped_blocks(num_blocks)
    if wrapped == 0:
        return saved_bytes
    share = selective_share if selective_share is not None and mode.name == "selective" else mode.saved_share
    one_block = saved_bytes / num_blocks
    kept = (num_blocks - wrapped) * one_block + wrapped * (block_input_bytes + share * one_block)
    return kept + (1.0 - share) * one_block


def describe(name: str) -> str:
    """What mode `name` does, in the words of a plan's reasons and memory notes."""
    return {"none": "no checkpointing",
            "selective": ("selective checkpointing per op (matmul and attention outputs saved, "
                          "norms, activations and every second matmul recomputed)"),
            "every-other": "every second block checkpointed",
            "full": "every block checkpointed"}[mode_of(name).name]


__all__ = ["CheckpointingMode", "MODES", "LABELS", "mode_of", "recompute_share", "kept_activation_bytes", "describe",
           "SELECTIVE_MATMUL_RECOMPUTED", "SELECTIVE_ATTENTION_RECOMPUTED", "SELECTIVE_MEMORY_BOUND_RECOMPUTED",
           "SELECTIVE_SAVED_SHARE"]

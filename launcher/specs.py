"""Frozen, keyword-only dataclasses that describe a job: what to run, how, and what for.

`Strategy` and `LoaderSpec` are how a rank runs (launcher.runspec holds the knobs and the
LaunchSpec made of them); `ModelProfile` and `Goal` are what the planner plans from; the hardware
is `launcher.hardware.types`'. Plain values, no torch, no I/O: each validates itself in
`__post_init__` (with `check`) and raises a `DlaunchError` subclass, so a bad value is caught
where it is made. Messages name fields in backticks (`micro_batch`), never flags: the CLI puts
its flags in. Units are in the names: `_bytes`, `_gib`, `_s`. Every part of dlaunch imports this
module, ranks included: it imports only `launcher.errors`, never another part of dlaunch or torch.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Mapping
from dataclasses import dataclass

from launcher.errors import PlanError, UsageError

GIB = 1024**3

DEVICES = ("cuda", "cpu")
STRATEGIES = ("ddp", "zero1", "fsdp_full", "fsdp_grad_op", "hybrid")
# the kinds under DDP's wrapper: every rank keeps every parameter whole and autocast runs mixed precision;
# zero1 shards the optimizer's state (runtime.zero), the others (FSDP2) shard all the state
DDP_KINDS = ("ddp", "zero1")
PRECISIONS = ("fp32", "bf16", "fp16")
# float8 training (torchao's Float8Linear, the rest in bf16): off, or its scaling recipe
FLOAT8_RECIPES = ("none", "tensorwise", "rowwise")
NO_TORCHAO = ("`float8` {recipe} converts the linear layers with torchao, which is not installed: "
              "pip install 'dlaunch[float8]' (or drop `float8`)")
FLOAT8_NEEDS_BF16 = ("`float8` runs the linear layers' GEMMs in float8 and everything else in bf16: "
                     "use `precision` bf16 with it")
# the dtype gradients are reduced in across ranks: fp32 (torchtitan's default, and what DDP's fp32 .grad buckets
# hold), or bf16 (FSDP's MixedPrecisionPolicy reduce_dtype; DDP's buckets cast by runtime.wrap's hook): half the
# bytes, as fms-fsdp's bfSixteen policy and Composer's PURE mixed precision (llm-foundry) reduce
REDUCE_DTYPES = ("fp32", "bf16")
REDUCE_DTYPE_BYTES = {"fp32": 4, "bf16": 2}
REDUCE_NEEDS_BF16 = ("`reduce_dtype` bf16 reduces the gradients of a bf16 run in bf16; use `precision` bf16 with "
                     "it, or `reduce_dtype` fp32")
# FSDP's unit of gathering: each of the workload's blocks (torchtitan's), or inside each block each nn.Linear on its
# own and the block the rest (DeepSpeed ZeRO-3 fetches per submodule; Accelerate's size-based wrap is alike)
FSDP_UNITS = ("block", "linear")
LINEAR_UNITS_NEED = ("`fsdp_unit` linear shards each linear layer of an FSDP strategy's blocks on its own; use "
                     "`strategy` fsdp_full, fsdp_grad_op or hybrid without `tp`, `compile` (FSDP's hooks would sit "
                     "inside each compiled block) or `checkpointing` selective (a selectively checkpointed block's "
                     "recompute replays its forward's ops one for one, and those hooks run other ops in it), or "
                     "`fsdp_unit` block")
OFFLOAD_NEEDS_FSDP = ("`offload` keeps FSDP's sharded state in host memory; DDP and ZeRO-1 keep whole parameters "
                      "on the device: use `strategy` fsdp_full, fsdp_grad_op or hybrid, or drop `offload`")
MIN_HANG_TIMEOUT_S = 10.0  # twice the harness's flush interval
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week; also keeps inf/nan out of the collective timeout
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# modes that capture CUDA graphs: FSDP's collectives and hooks cannot live inside one
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
SWEEP_MODES = ("weak", "strong")  # `dlaunch scale --mode`
# activation checkpointing of the workload's repeated blocks: none; selective (torchtitan's per-op
# policy on every block); every-other (every second block whole); full (every block whole).
# launcher.plan.checkpointing prices each, launcher.runtime.wrap applies it
CHECKPOINTING = ("none", "selective", "every-other", "full")
TRACKERS = ("tensorboard", "mlflow", "wandb")  # `dlaunch run --log-to` (launcher.results.trackers)
# kernels a run calls where the meta-device profile cannot tell (it records the op, not its implementation):
# attention (PyTorch SDPA; flash-attn 2; Triton FlashAttention, flash_attn_triton; written out, eager), the loss
# (cross entropy as eager aten ops; flash-attn's fused cross entropy) and the norms (as autocast runs them, in
# fp32; in the compute dtype, llm-foundry's low_precision_layernorm). The cost model prices each (plan.attention:
# ATTENTION_CURVES, EAGER_HEAD_DIM; launcher.plan.cost: FUSED_LOSS_PASSES, NORM_AUTOCAST_BYTES).
# selective checkpointing's save list, by aten op name (torchtitan's `_save_list`, plus addmm, a linear with a
# bias, and CPU's flash kernel): every second matmul's output is saved, the others' always; the rest recomputed.
# launcher.runtime.wrap applies it, launcher.plan.profile_passes measures what it keeps
SELECTIVE_SAVED_MATMULS = ("mm", "addmm")
SELECTIVE_SAVED_OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                       "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu", "max")
ATTENTION_KERNELS = ("sdpa", "fa2", "triton-fa", "eager")
LOSS_KERNELS = ("eager", "fused")
NORM_KERNELS = ("eager", "low-precision")
# `dlaunch tune` trials without --steps: at least TRIAL_STEPS, or enough to time TRIAL_TIMED_S
# of the fastest candidate's steps (launcher.drivers.tune says why)
TRIAL_STEPS = 12
TRIAL_TIMED_S = 2.0
DEFAULT_TIME_MIN = 60.0  # SLURM time limit; > 10 min: below that, submitit takes every USR2 for a time-out


def has_torchao() -> bool:
    """Whether torchao (which float8 training needs) is installed: found, not imported (the CLI stays fast)."""
    return importlib.util.find_spec("torchao") is not None


def require_torchao(recipe: str) -> None:
    """UsageError in one line when `float8` `recipe` is asked for and torchao is missing."""
    check(recipe in (None, "none") or has_torchao(), UsageError, NO_TORCHAO.format(recipe=recipe))


def linear_units_ok(*, strategy: str | None, tp: int | None, compile: bool | None, checkpointing: str | None) -> bool:
    """Whether `fsdp_unit` linear can run beside these (None: not decided yet); LINEAR_UNITS_NEED says why not."""
    return strategy not in DDP_KINDS and (tp or 1) == 1 and not compile and checkpointing != "selective"


def check(cond: bool, err: type[Exception], msg: str) -> None:
    """Raise `err(msg)` unless `cond`: the one-line validation every spec's __post_init__ uses."""
    if not cond:
        raise err(msg)


def checkpointing_mode(value: object) -> str:
    """One of CHECKPOINTING from a mode name, or from the bool that files written before the
    modes hold (true: every block, "full"; false: "none"); UsageError for anything else."""
    if isinstance(value, bool):
        return "full" if value else "none"
    check(isinstance(value, str) and value in CHECKPOINTING, UsageError,
          f"unknown `checkpointing` {value!r}; use one of {', '.join(CHECKPOINTING)}")
    return str(value)


@dataclass(frozen=True, kw_only=True)
class ModelProfile:
    """What the planner needs to know about a model, measured on the meta device."""

    name: str
    num_params: int
    bytes_by_dtype: Mapping[str, int]
    num_blocks: int
    largest_block_params: int
    activation_bytes_per_sample: float  # saved for backward, per sample, at the profiled dtype
    block_input_bytes_per_sample: float  # one block's input: what checkpointing keeps per block
    flops_fwd_per_sample: float
    units_per_sample: int = 1  # e.g. tokens per sequence
    sample_units: str = "samples"
    # the workload's optimizer (class name; "" = not profiled: the goal's optimizer is assumed)
    # and its persistent state per parameter of the model (AdamW 8, SGD with momentum 4)
    optimizer: str = ""
    optimizer_state_bytes_per_param: float = 0.0
    # whether it steps in one fused kernel (its param groups' `fused`); None = dlaunch's default optimizer,
    # fused on CUDA ranks and the per-tensor loop on CPU ones (runtime.wrap), or not profiled
    optimizer_fused: bool | None = None
    # aten ops one micro-batch's forward dispatches (independent of its size) and parameter
    # tensors: what per-op overhead scales with on CPU (0 = not profiled: no overhead modelled)
    forward_ops: int = 0
    param_tensors: int = 0
    # the parts of flops_fwd_per_sample that are attention (4 s^2 d per layer: where SDPA, flash-attn or
    # nn.MultiheadAttention is called, or the matmuls around a softmax of scores) and convolutions; 0 = none
    attention_flops_fwd_per_sample: float = 0.0
    conv_flops_fwd_per_sample: float = 0.0
    batch_norms: int = 0  # BatchNorm modules: FSDP units of their own under bf16/fp16
    # the most bytes backward holds at once beyond the saved activations, per sample at the profiled dtype
    # (a language model's loss gradient over its vocabulary: two logits-sized tensors); 0 = none, or not profiled
    backward_transient_bytes_per_sample: float = 0.0
    # what SDPA saves beyond flash attention's where it runs its math path (attention with dropout on CPU, whose
    # flash kernel takes none; CUDA's does), per sample at the profiled dtype; 0 = none, or not profiled
    math_attention_bytes_per_sample: float = 0.0
    # attention written out (kernel "eager"): the bytes of the scores its softmaxes output, per sample at the
    # profiled dtype, of the activation bytes above (held by softmax's backward and the next matmul); 0 = none
    attention_scores_bytes_per_sample: float = 0.0
    attention_scores_upcast_bytes_per_sample: float = 0.0  # of those, softmaxed into fp32 (`dtype=torch.float32`)
    # of one block's saved-for-backward bytes, the share selective checkpointing keeps: the outputs of the ops its
    # save list names (SELECTIVE_SAVED_MATMULS, every second; SELECTIVE_SAVED_OPS), measured on the first block;
    # None = not profiled (launcher.plan.checkpointing's SELECTIVE_SAVED_SHARE then)
    selective_saved_share: float | None = None
    # tensor-parallel degrees above 1 the workload's `tp_plan(model, tp)` accepts (those that
    # divide its heads); () = no tp_plan, or not profiled: the plan never proposes TP
    tp_degrees: tuple[int, ...] = ()
    # whether that tp_plan keeps the logits split over the vocabulary (loss parallel): under TP the loss and its
    # gradient are then 1/tp on each rank, not whole
    tp_loss_parallel: bool = False
    # FSDP units of linear layers (`Strategy.fsdp_unit` linear): the most parameters one holds (a block's nn.Linear,
    # or what its block keeps beside them) and the most a block has (its linears + the block); 0 = not profiled
    linear_unit_params: int = 0
    linear_units_per_block: int = 0
    # how the model was profiled where that is not as it trains (the workload's word, e.g. an
    # MoE's routing stood in for on the meta device); "" = as it trains
    profile_note: str = ""
    # the run's attention, loss and norm kernels: inputs of the plan, not measured; the defaults are what
    # dlaunch's workloads call (F.scaled_dot_product_attention, F.cross_entropy, nn.LayerNorm/RMSNorm under autocast)
    attention_kernel: str = "sdpa"
    loss_kernel: str = "eager"
    norm_kernel: str = "eager"

    def __post_init__(self) -> None:
        check(self.num_params > 0, PlanError, f"model {self.name} has no parameters")
        check(self.attention_kernel in ATTENTION_KERNELS and self.loss_kernel in LOSS_KERNELS
              and self.norm_kernel in NORM_KERNELS, PlanError,
              f"model {self.name}: attention kernel {self.attention_kernel!r} (one of {', '.join(ATTENTION_KERNELS)}), "
              f"loss kernel {self.loss_kernel!r} (one of {', '.join(LOSS_KERNELS)}), norm kernel "
              f"{self.norm_kernel!r} (one of {', '.join(NORM_KERNELS)})")
        check(self.forward_ops >= 0 and self.param_tensors >= 0, PlanError,
              f"model {self.name}: negative op or parameter tensor count")
        check(self.optimizer_state_bytes_per_param >= 0, PlanError,
              f"model {self.name}: negative optimizer state bytes")
        check(self.activation_bytes_per_sample >= 0 and self.backward_transient_bytes_per_sample >= 0
              and 0 <= self.attention_scores_upcast_bytes_per_sample <= self.attention_scores_bytes_per_sample
              <= self.activation_bytes_per_sample * (1 + 1e-9), PlanError,
              f"model {self.name}: negative activation bytes, or attention scores that are not a part of them")
        check(self.units_per_sample >= 1, PlanError, f"model {self.name}: units_per_sample must be >= 1")
        check(self.selective_saved_share is None or 0.0 <= self.selective_saved_share <= 1.0, PlanError,
              f"model {self.name}: selective_saved_share must be in [0, 1], got {self.selective_saved_share}")
        check(0 <= self.attention_flops_fwd_per_sample + self.conv_flops_fwd_per_sample
              <= self.flops_fwd_per_sample * (1 + 1e-9) and self.attention_flops_fwd_per_sample >= 0
              and self.conv_flops_fwd_per_sample >= 0 and self.batch_norms >= 0, PlanError,
              f"model {self.name}: attention and convolution FLOPs must be parts of the forward's")

    @property
    def param_bytes(self) -> int:
        """Bytes of all parameters at their stored dtype."""
        return sum(self.bytes_by_dtype.values())


@dataclass(frozen=True, kw_only=True)
class Strategy:
    """How each rank wraps and runs the model."""

    kind: str = "ddp"
    precision: str = "fp32"
    checkpointing: str = "none"  # one of CHECKPOINTING
    compile: bool = False
    compile_mode: str = "default"
    compile_strict: bool = False  # fullgraph=True, and a compile failure fails the run
    # tensor-parallel degree: ranks of one node that split every block's matmuls (DTensor, with
    # sequence parallelism), the FSDP kind sharding over the rest (a 2-D mesh ("dp", "tp"))
    tp: int = 1
    # FSDP2's CPUOffloadPolicy: the sharded fp32 parameters, gradients and optimizer state live
    # in host memory and the optimizer steps on the CPU (launcher.plan.offload prices it)
    offload: bool = False
    float8: str = "none"  # one of FLOAT8_RECIPES (launcher.runtime.float8, launcher.plan.float8)
    reduce_dtype: str = "fp32"  # one of REDUCE_DTYPES: what the gradients cross the ranks in
    fsdp_unit: str = "block"  # one of FSDP_UNITS

    def __post_init__(self) -> None:
        check(self.fsdp_unit in FSDP_UNITS, UsageError,
              f"unknown `fsdp_unit` {self.fsdp_unit!r}; use one of {', '.join(FSDP_UNITS)}")
        check(self.fsdp_unit == "block" or linear_units_ok(
            strategy=self.kind, tp=self.tp, compile=self.compile, checkpointing=self.checkpointing),
              UsageError, LINEAR_UNITS_NEED)
        check(self.reduce_dtype in REDUCE_DTYPES, UsageError,
              f"unknown `reduce_dtype` {self.reduce_dtype!r}; use one of {', '.join(REDUCE_DTYPES)}")
        check(self.reduce_dtype == "fp32" or self.precision == "bf16", UsageError, REDUCE_NEEDS_BF16)
        check(self.float8 in FLOAT8_RECIPES, UsageError,
              f"unknown `float8` recipe {self.float8!r}; use one of {', '.join(FLOAT8_RECIPES)}")
        check(self.float8 == "none" or self.precision == "bf16", UsageError, FLOAT8_NEEDS_BF16)
        check(not self.offload or self.kind not in DDP_KINDS, UsageError, OFFLOAD_NEEDS_FSDP)
        check(isinstance(self.tp, int) and self.tp >= 1, UsageError,
              f"`tp` (the tensor-parallel degree) must be an integer >= 1, got {self.tp!r}")
        check(self.tp == 1 or self.kind not in DDP_KINDS, UsageError,
              f"`tp` {self.tp} composes tensor parallelism with FSDP on the data-parallel dimension; "
              f"{'DDP' if self.kind == 'ddp' else self.kind} does not: use `strategy` fsdp_full, fsdp_grad_op or "
              "hybrid")
        check(self.kind in STRATEGIES, UsageError,
              f"unknown strategy {self.kind!r}; use one of {', '.join(STRATEGIES)}")
        check(self.precision in PRECISIONS, UsageError,
              f"unknown precision {self.precision!r}; use one of {', '.join(PRECISIONS)}")
        check(self.compile_mode in COMPILE_MODES, UsageError,
              f"unknown compile mode {self.compile_mode!r}; use one of {', '.join(COMPILE_MODES)}")
        check(self.checkpointing in CHECKPOINTING, UsageError,
              f"unknown `checkpointing` {self.checkpointing!r}; use one of {', '.join(CHECKPOINTING)}")
        check(not (self.compile and self.shards_params and self.compile_mode in CUDA_GRAPH_MODES), UsageError,
              f"`compile_mode` {self.compile_mode} captures CUDA graphs, which FSDP ({self.kind}) does not support; "
              "use `compile_mode` default or max-autotune-no-cudagraphs")

    @property
    def shards_params(self) -> bool:
        """FSDP2 (fsdp_full, fsdp_grad_op, hybrid): parameters and gradients sharded, mixed
        precision by its parameter policy; False for the DDP_KINDS (whole parameters, autocast)."""
        return self.kind not in DDP_KINDS

    def builds_once(self, world_size: int) -> bool:
        """Whether rank 0 alone builds the model in host memory, the others on meta (runtime.build)."""
        return self.shards_params and world_size > 1

    @property
    def reduce_bytes(self) -> int:
        """Bytes a gradient element moves in the gradient reduction (`reduce_dtype`)."""
        return REDUCE_DTYPE_BYTES[self.reduce_dtype]

    @property
    def recomputes(self) -> bool:
        """Whether any block recomputes its forward in backward (every mode but none)."""
        return self.checkpointing != "none"

    @property
    def uses_grad_scaler(self) -> bool:
        """fp16 needs loss scaling; bf16 and fp32 do not."""
        return self.precision == "fp16"


@dataclass(frozen=True, kw_only=True)
class LoaderSpec:
    """DataLoader settings the harness applies to every workload's dataset (only `num_workers` is a knob)."""

    num_workers: int = 0
    prefetch_factor: int = 2
    persistent_workers: bool = True
    pin_memory: bool = True  # only takes effect on CUDA
    shuffle: bool = True


@dataclass(frozen=True, kw_only=True)
class Goal:
    """What the user wants trained: global batch, sequence length, optimizer."""

    global_batch: int | None = None  # samples per optimizer step; None: the planner picks
    seq_len: int | None = None  # overrides the profile's units_per_sample for sequence models
    optimizer: str = "adamw"
    headroom: float = 0.10  # fraction of device memory a plan must leave free

    def __post_init__(self) -> None:
        check(self.global_batch is None or self.global_batch >= 1, UsageError,
              f"`global_batch` must be >= 1, got {self.global_batch}")
        check(self.seq_len is None or self.seq_len >= 1, UsageError, f"`seq_len` must be >= 1, got {self.seq_len}")
        check(self.optimizer in ("adamw", "sgd"), UsageError, f"unknown optimizer {self.optimizer!r}; use adamw or sgd")
        check(0 <= self.headroom < 1, UsageError, f"headroom must be in [0, 1), got {self.headroom}")


@dataclass(frozen=True, kw_only=True)
class SlurmSpec:
    """How to ask SLURM for the job (what `--partition`, `--slurm-opt`, ... and dlaunch.yaml say)."""

    partition: str | None = None
    time_min: float = DEFAULT_TIME_MIN
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    opts: tuple[tuple[str, str], ...] = ()  # extra sbatch options, sorted (key, value)
    cpus_per_node: int | None = None  # None: not known (dry run away from SLURM); not requested
    queue_timeout_min: float | None = None  # cancel when still pending after this long
    detach: bool = False

    def __post_init__(self) -> None:
        if not (self.time_min > 0 and math.isfinite(self.time_min)):
            raise UsageError(f"--time-min must be a number of minutes > 0, got {self.time_min}")
        if self.queue_timeout_min is not None and not self.queue_timeout_min > 0:
            raise UsageError(f"--queue-timeout-min must be > 0, got {self.queue_timeout_min}")
        if self.cpus_per_node is not None and self.cpus_per_node < 1:
            raise UsageError(f"--cpus-per-node must be >= 1, got {self.cpus_per_node}")
        for name in ("partition", "account", "qos", "constraint"):
            if (value := getattr(self, name)) is not None:
                check_slurm_value(f"--{name}", value)


def check_slurm_value(flag: str, value: str) -> None:
    """A SLURM option's value: non-empty, no control characters (UsageError otherwise)."""
    # a newline in a value would end the #SBATCH line and run the rest as shell in the job
    if not value or any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise UsageError(f"{flag} must be a non-empty value without control characters, got {value!r}")

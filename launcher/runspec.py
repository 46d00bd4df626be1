"""What a run is: every knob, declared once (`RunSettings`), and the `LaunchSpec` a backend
starts and every rank reads back (launch.json).

A knob is a field of `RunSettings` declared with `launcher.knobs.knob`; the CLI's options, the
request and LaunchSpec derive from those fields. LaunchSpec is the settings with every decision
made (the plan's, else the knob's fallback) plus the run's identity. Plain values: no torch, no
I/O; imported by every part of dlaunch, ranks included, so it imports only errors, knobs, specs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from launcher.errors import UsageError
from launcher.knobs import (
    MAX_GLOBAL_BATCH,
    MAX_SAMPLES,
    MAX_STEPS,
    at_least,
    knob,
    knobs_of,
    migrate,
    non_negative,
    number,
    set_for_script,
    validate_knobs,
)
from launcher.specs import (
    ATTENTION_KERNELS,
    CHECKPOINTING,
    COMPILE_MODES,
    CUDA_GRAPH_MODES,
    DDP_KINDS,
    DEVICES,
    FLOAT8_NEEDS_BF16,
    FLOAT8_RECIPES,
    FSDP_UNITS,
    LINEAR_UNITS_NEED,
    LOSS_KERNELS,
    MAX_TIMEOUT_S,
    MIN_HANG_TIMEOUT_S,
    NORM_KERNELS,
    OFFLOAD_NEEDS_FSDP,
    PRECISIONS,
    REDUCE_DTYPES,
    REDUCE_NEEDS_BF16,
    STRATEGIES,
    LoaderSpec,
    Strategy,
    check,
    linear_units_ok,
)

_PLANS = " (default: the plan's)"
# the largest machine a topology may describe (launcher.hardware.topology's MAX_DEVICES_PER_NODE
# and MAX_NODES; tests/unit/test_knobs.py checks they agree): past them, a typo
MAX_GPUS = 4096
MAX_NODES = 100_000
# the kernel knobs: what the run calls, for the plan's price (launcher.plan.kernels)
_KERNEL = (" (the plan prices it; default: the workload's KERNELS table, else what the profile "
           "sees the model call, else {})")


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """Every knob of a run, declared once (`launcher.knobs.knob`). A decision the plan makes is
    None until made (`planned`); each value is checked here, before anything is planned or written."""

    gpus: int = knob(1, "--gpus", "processes per node: GPUs, or CPU processes when there is no GPU",
                     unit="processes", check=at_least(1, MAX_GPUS), script=True)
    nodes: int = knob(1, "--nodes", "nodes (default 1)", unit="nodes", check=at_least(1, MAX_NODES), script=True)
    steps: int = knob(20, "--steps", "optimizer steps", unit="steps", check=at_least(1, MAX_STEPS))
    warmup_steps: int | None = knob(None, "--warmup-steps", "steps left out of throughput (default: min(3, steps - 1))",
                                    unit="steps", check=at_least(0, MAX_STEPS), script=True)
    micro_batch: int | None = knob(None, "--micro-batch", "samples per rank per forward pass" + _PLANS, unit="samples",
                                   check=at_least(1, MAX_SAMPLES), planned=True, fallback=8)
    grad_accum: int | None = knob(None, "--grad-accum", "micro-batches per optimizer step" + _PLANS,
                                  unit="micro-batches", check=at_least(1, MAX_GLOBAL_BATCH),
                                  planned=True, fallback=1)  # the plan's reach: the global batch's bound
    strategy: str | None = knob(None, "--strategy", "how the ranks share the model: ddp, zero1, fsdp_full, "
                                "fsdp_grad_op or hybrid" + _PLANS, choices=STRATEGIES, planned=True, fallback="ddp")
    precision: str | None = knob(None, "--precision", "the compute dtype (autocast)" + _PLANS,
                                 choices=PRECISIONS, planned=True, fallback="fp32")
    checkpointing: str | None = knob(
        None, "--checkpointing", "activation checkpointing of the workload's blocks: none; selective (per op: matmul "
        "and attention outputs saved, the rest recomputed); every-other (every second block recomputed whole); full "
        "(every block)" + _PLANS, choices=CHECKPOINTING, planned=True, fallback="none")
    compile: bool | None = knob(None, "--compile", "torch.compile the model (default: the plan's: on "
                                "for GPUs where Dynamo traces the workload without a graph break, off "
                                "on CPUs)", kind="toggle", planned=True, fallback=False)
    compile_mode: str | None = knob(None, "--compile-mode", "torch.compile mode (implies --compile; "
                                    "default: default)", choices=COMPILE_MODES, fallback="default")
    compile_strict: bool = knob(False, "--compile-strict", "fullgraph=True, and a compile failure fails the run "
                                "instead of falling back to eager (implies --compile)", kind="switch")
    tp: int | None = knob(None, "--tp", "tensor-parallel degree: ranks of one node that split every "
                          "block's matmuls (DTensor, sequence parallel), FSDP sharding over the rest; "
                          "needs the workload's tp_plan(model, tp) (default: the plan's; 1 on CPUs)",
                          unit="ranks", check=at_least(1, MAX_GPUS), planned=True, fallback=1)
    float8: str | None = knob(None, "--float8", "float8 training of the linear layers (torchao's Float8Linear; CPU "
                              "ranks emulate it), the rest in bf16: none, tensorwise or rowwise scaling (default: the "
                              "plan's: none, or a recipe on GPUs with float8 tensor cores where predicted faster)",
                              choices=FLOAT8_RECIPES, planned=True, fallback="none")
    offload: bool | None = knob(None, "--offload", "FSDP CPU offload: sharded parameters, gradients and optimizer "
                                "state in host memory, the optimizer step on the CPU (default: the plan's: on only "
                                "where nothing else fits the GPUs)", kind="toggle", planned=True, fallback=False)
    reduce_dtype: str | None = knob(
        None, "--reduce-dtype", "the dtype the gradients are reduced in across ranks: fp32, or bf16 (half the "
        "bytes, bf16's rounding in the sum: FSDP's reduce_dtype, DDP's buckets cast to bf16; needs --precision bf16) "
        "(default fp32)", choices=REDUCE_DTYPES, fallback="fp32")
    fsdp_unit: str | None = knob(
        None, "--fsdp-unit", "FSDP's unit of gathering: block (each of the workload's blocks, one all-gather and one "
        "reduce-scatter each) or linear (each linear layer in a block a unit of its own, the block the rest: fewer "
        "parameters gathered at once for more collectives, as DeepSpeed's ZeRO-3 gathers per submodule; not with "
        "--tp or --compile) (default: the plan's: block, or linear where nothing fits with blocks)",
        choices=FSDP_UNITS, planned=True, fallback="block")
    attention_kernel: str | None = knob(
        None, "--attention-kernel", "the attention kernel the model calls: sdpa (PyTorch's "
        "scaled_dot_product_attention), fa2 (the flash-attn package), triton-fa (Triton "
        "FlashAttention), eager (written out: q @ k^T, softmax, @ v; Hugging Face's attn_implementation=\"eager\")"
        + _KERNEL.format("sdpa"), choices=ATTENTION_KERNELS)
    loss_kernel: str | None = knob(
        None, "--loss-kernel", "the loss over the vocabulary: eager (F.cross_entropy), fused (one kernel that saves no "
        "log-softmax: flash-attn's or Liger's cross entropy)" + _KERNEL.format("eager"), choices=LOSS_KERNELS)
    norm_kernel: str | None = knob(
        None, "--norm-kernel", "the norms: eager (as autocast runs them, in fp32), low-precision "
        "(in the compute dtype, one pass: llm-foundry's low-precision norms, fused RMSNorm and "
        "LayerNorm kernels)" + _KERNEL.format("eager"), choices=NORM_KERNELS)
    shard_group_size: int | None = knob(None, "--shard-group-size", "hybrid shard: ranks per shard group (default: the "
                                        "ranks of a node)", unit="ranks", check=at_least(1, MAX_GPUS * MAX_NODES))
    profile: bool = knob(False, "--profile", "torch.profiler over 3 steps after warm-up: trace-rank<r>.json per rank "
                         "and the top operators in the summary", kind="switch")
    memory_snapshot: bool = knob(False, "--memory-snapshot", "CUDA only: record allocations, dump "
                                 "memory-rank<r>.pickle at the end or on out-of-memory", kind="switch")
    detect_anomaly: bool = knob(False, "--detect-anomaly", "autograd anomaly detection: find the op "
                                "that makes NaNs (slow)", kind="switch")
    stop_on_nan: bool = knob(False, "--stop-on-nan", "end the run (failed) at the first NaN or "
                             "infinite loss; without it, a warning", kind="switch")
    eval_every: int = knob(0, "--eval-every", "run the workload's evaluate(model, cfg) after every N "
                           "optimizer steps (0: never)", unit="steps", check=at_least(0, MAX_STEPS))
    seed: int = knob(0, "--seed", "the one seed of model init and data order",
                     check=at_least(0, 2**32 - 1))  # numpy's seeds end there
    log_every: int | None = knob(None, "--log-every", "steps per logging window (one host sync and one all-reduce of "
                                 "the losses per window; default: 10, or as many as take 0.5 s when 10 steps take "
                                 "less)", unit="steps", check=at_least(1, MAX_STEPS))
    max_grad_norm: float = knob(0.0, "--max-grad-norm", "clip the global gradient norm once per "
                                "optimizer step (0: off)", check=non_negative(1e9))
    calibrate: bool = knob(True, "--calibrate", "measure exposed communication and busbw in a "
                           "window after warm-up (--no-calibrate skips it)", kind="toggle",
                           script=True)  # a plain script is never calibrated: off is honoured
    num_workers: int = knob(0, "--num-workers", "DataLoader worker processes per rank",
                            unit="processes", check=at_least(0, 1024))
    hang_timeout_s: float = knob(300.0, "--hang-timeout-s", "end the job when no rank advanced for "
                                 "this long (0: never); the collective timeout is twice this "
                                 "(default 300)", unit="s", check=number(MAX_TIMEOUT_S), script=True)
    startup_timeout_s: float | None = knob(None, "--startup-timeout-s", "allowance before every rank finished step 1: "
                                           "imports, model build, compile, rendezvous (default max(900, "
                                           "--hang-timeout-s))", unit="s", check=number(MAX_TIMEOUT_S), script=True)
    max_restarts: int = knob(0, "--max-restarts", "relaunch a failed job up to N times (fresh "
                             "rendezvous, same run dir); it resumes from the last checkpoint (see "
                             "--checkpoint-every)", check=at_least(0, 10_000), script=True)
    checkpoint_every: int = knob(0, "--checkpoint-every", "save a checkpoint (torch.distributed.checkpoint, "
                                 "RUN_DIR/checkpoints) every N optimizer steps (0: only on the preemption signal); "
                                 "restarts and SLURM requeues resume from the newest with the same data order",
                                 unit="steps", check=at_least(0, MAX_STEPS))

    def __post_init__(self) -> None:
        validate_knobs(self)
        check(not self.tp or self.tp == 1 or self.strategy not in DDP_KINDS, UsageError,
              f"`tp` {self.tp} composes tensor parallelism with FSDP on the data-parallel dimension; DDP does not, "
              "nor does ZeRO-1: use `strategy` fsdp_full, fsdp_grad_op or hybrid")
        check(not (self.compile and self.strategy not in (None, *DDP_KINDS) and self.compile_mode in CUDA_GRAPH_MODES),
              UsageError, f"`compile_mode` {self.compile_mode} captures CUDA graphs, which FSDP ({self.strategy}) does "
                          "not support; use `compile_mode` default or max-autotune-no-cudagraphs")
        check(not self.offload or self.strategy not in DDP_KINDS, UsageError, OFFLOAD_NEEDS_FSDP)
        check(self.fsdp_unit != "linear" or linear_units_ok(strategy=self.strategy, tp=self.tp, compile=self.compile,
                                                              checkpointing=self.checkpointing),
              UsageError, LINEAR_UNITS_NEED)
        check(self.float8 in (None, "none") or self.precision in (None, "bf16"), UsageError, FLOAT8_NEEDS_BF16)
        check(self.reduce_dtype in (None, "fp32") or self.precision in (None, "bf16"), UsageError, REDUCE_NEEDS_BF16)
        check(self.shard_group_size is None or self.strategy in (None, "hybrid"), UsageError,
              f"`shard_group_size` applies to `strategy` hybrid only, got `strategy` {self.strategy}")
        # ranks beat at least every MIN_HANG_TIMEOUT_S / 2 while they advance (the harness
        # flushes every 5 s): a shorter timeout would call a healthy job hung
        check(self.hang_timeout_s == 0 or MIN_HANG_TIMEOUT_S <= self.hang_timeout_s <= MAX_TIMEOUT_S,
              UsageError, f"`hang_timeout_s` must be 0 (off) or between {MIN_HANG_TIMEOUT_S:g} "
                          f"and {MAX_TIMEOUT_S:g} seconds, got {self.hang_timeout_s:g}")
        check(self.startup_timeout_s is None or self.hang_timeout_s <= self.startup_timeout_s <= MAX_TIMEOUT_S,
              UsageError, f"`startup_timeout_s` must be between `hang_timeout_s` ({self.hang_timeout_s:g}) "
                          f"and {MAX_TIMEOUT_S:g} seconds, got {self.startup_timeout_s or 0:g}")

    def check_warmup(self, *, is_script: bool) -> None:
        """Warm-up below the steps (made before planning, which profiles the workload: a typo costs
        nothing); a plain script runs the steps it likes, so `steps` does not bound its warm-up."""
        check(is_script or self.warmup_steps is None or self.warmup_steps < self.steps, UsageError,
              f"`warmup_steps` must be below `steps` ({self.steps}), got {self.warmup_steps}")

    def decided(self) -> dict[str, Any]:
        """Each plan decision as made, else its fallback (what runs when nothing planned)."""
        return {k: d.fallback if getattr(self, k) is None else getattr(self, k)
                for k, d in knobs_of(RunSettings).items() if d.planned}

    def knob_values(self) -> dict[str, Any]:
        """Every knob by name (a shallow copy: what LaunchSpec is made from)."""
        return {k: getattr(self, k) for k in knobs_of(RunSettings)}

    @property
    def world_size(self) -> int:
        """Total ranks across all nodes."""
        return self.nodes * self.gpus


@dataclass(frozen=True, kw_only=True)
class LaunchSpec(RunSettings):
    """Everything a backend needs to start a job and every rank needs to run it: the knobs with
    every decision made (a decision left open takes its fallback), and the run's identity."""

    workload: str  # absolute path of the workload file or plain script
    workload_args: tuple[str, ...] = ()
    is_script: bool = False  # a plain torchrun script: launched unchanged
    run_id: str
    run_dir: str  # absolute
    device: str = "cpu"
    env: Mapping[str, str] = field(default_factory=dict)  # extra environment for the ranks
    if TYPE_CHECKING:  # every decision made (the checker's view; __post_init__ makes it so)
        warmup_steps: int
        micro_batch: int
        grad_accum: int
        strategy: str
        precision: str
        checkpointing: str
        compile: bool
        compile_mode: str
        tp: int
        offload: bool
        float8: str
        reduce_dtype: str
        fsdp_unit: str
        startup_timeout_s: float

    def __post_init__(self) -> None:
        warmup = min(3, self.steps - 1) if self.warmup_steps is None else self.warmup_steps
        startup = max(900.0, self.hang_timeout_s) if self.startup_timeout_s is None else self.startup_timeout_s
        made = {"compile_mode": self.compile_mode or "default", "reduce_dtype": self.reduce_dtype or "fp32",
                "warmup_steps": warmup, "startup_timeout_s": startup,
                # unplanned (SLURM without a topology), a bf16 reduce takes the precision it needs
                **({"precision": "bf16"} if self.precision is None and self.reduce_dtype == "bf16" else {})}
        for name, value in {**self.decided(), **made}.items():
            object.__setattr__(self, name, value)
        super().__post_init__()
        self.check_warmup(is_script=self.is_script)
        check(self.device in DEVICES, UsageError, f"device must be one of {DEVICES}")
        check(self.gpus % self.tp == 0, UsageError, f"`tp` {self.tp} must divide the processes per node "
                                                    f"({self.gpus}): tensor parallelism stays inside a node")
        check(self.shard_group_size is None or self.world_size % self.shard_group_size == 0, UsageError,
              f"`shard_group_size` must divide the world size ({self.world_size}), got {self.shard_group_size}")
        # the profiler skips warm-up, then needs one step of its own warm-up and one to record
        check(not self.profile or self.steps >= self.warmup_steps + 2, UsageError,
              f"`profile` needs `steps` >= warm-up steps + 2 ({self.warmup_steps + 2}), got {self.steps}")
        check(not self.memory_snapshot or self.device == "cuda", UsageError,
              "`memory_snapshot` records CUDA allocations and needs a GPU; this run is on CPU (use `profile` for CPU "
              "time per operator)")
        check(not (self.eval_every and self.is_script), UsageError,
              "`eval_every` needs a workload with evaluate(model, cfg); a plain script evaluates itself")
        check(not (self.checkpoint_every and self.is_script), UsageError,
              "`checkpoint_every` needs a workload: dlaunch's harness saves the checkpoints, and a plain script saves "
              "its own")
        for name in set_for_script(self) if self.is_script else ():
            value = getattr(self, name)
            given = "" if isinstance(value, bool) else f" {value}"
            raise UsageError(f"`{name}`{given} is for workloads: a plain script runs its own training loop and would "
                             "ignore it; drop it, or give the script its own flag after `--`")

    @property
    def parallel(self) -> Strategy:
        """How each rank wraps and runs the model, as the planner and the runtime's wrap see it."""
        return Strategy(kind=self.strategy, precision=self.precision, checkpointing=self.checkpointing,
                        compile=self.compile, compile_mode=self.compile_mode, compile_strict=self.compile_strict,
                        tp=self.tp, offload=self.offload, float8=self.float8,
                        reduce_dtype=self.reduce_dtype, fsdp_unit=self.fsdp_unit)

    @property
    def loader(self) -> LoaderSpec:
        """The DataLoader settings of every rank."""
        return LoaderSpec(num_workers=self.num_workers)

    @property
    def collective_timeout_s(self) -> float:
        """The process group's timeout: twice the hang timeout (30 min when off), so that the launcher's
        watcher, which can name the stuck rank, acts first; this is the backstop when nothing watches."""
        return 2 * self.hang_timeout_s if self.hang_timeout_s > 0 else 1800.0

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: the world over the TP degree (one TP group's ranks read the same micro-batch)."""
        return self.world_size // self.tp

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step across all data-parallel ranks."""
        return self.micro_batch * self.grad_accum * self.dp_size

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (what ranks read back with `from_dict`): one key per knob, as named."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LaunchSpec:
        """Rebuild a spec written by `to_dict`, in this or an earlier version (`knobs.migrate`)."""
        d = migrate(data)
        d["workload_args"] = tuple(d.get("workload_args", ()))
        return cls(**d)

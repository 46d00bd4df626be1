"""What a run measured: one rank's numbers and the whole run's, as `result.json` holds them.

Frozen, keyword-only values (no torch, no I/O), built by `results.aggregate` from the rank files.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from launcher.results.schema import dataclass_problem


@dataclass(frozen=True, kw_only=True)
class RankResult:
    """One rank's measurements, aggregated from its rank file."""

    rank: int
    local_rank: int
    node_rank: int
    host: str
    status: str  # ok | failed | hung | killed | exited | stopped | incomplete | missing | running (read live)
    steps: int  # optimizer steps recorded
    steady_steps: int  # steps after warm-up
    samples_per_s: float
    units_per_s: float
    step_time_median_s: float
    step_time_p90_s: float
    step_time_max_s: float
    data_wait_share: float
    peak_mem_bytes: int | None = None
    final_loss: float | None = None
    error: str | None = None
    log_tail: tuple[str, ...] = ()
    exposed_comm_s: float | None = None  # per step, from the sync-off/on calibration
    busbw_gb_s: float | None = None  # all-reduce of the gradient size
    tp_comm_s: float | None = None  # per step in tensor parallelism's collectives (runtime.tp_comm)
    straggler: bool = False
    skipped_steps: int = 0  # optimizer steps the fp16 GradScaler skipped (inf/NaN gradients)
    nonfinite_loss_step: int | None = None  # the first step with a NaN or infinite loss (null in JSON)
    # torch.compile, counted over the whole run (None when the run did not compile)
    compiled_graphs: int | None = None
    graph_breaks: int | None = None
    recompiles: int | None = None
    compile_fallback: str | None = None  # why compile failed and the rank ran eagerly
    # --profile: the rank's trace file and its top operators by self time (device on CUDA)
    profile_trace: str | None = None
    top_ops: tuple[Mapping[str, Any], ...] = ()
    device_busy_share: float | None = None  # CUDA kernel time / profiled step time
    resumed_from_step: int | None = None  # the last attempt's checkpoint (`steps` counts the steps before it)
    # wall seconds from the end of warm-up to the end of the last step; None without step end times
    measured_wall_s: float | None = None
    step_time_mean_s: float | None = None  # of the steady steps' own times (the breakdown's unit); None in old files
    # CPU: the peak of live tensor storages over one sampled training step (parameters,
    # optimizer state and every tensor the step made; runtime.live_bytes); `peak_mem_bytes` is
    # then the process's peak RSS. None where it was not measured (CUDA, plain scripts).
    live_peak_bytes: int | None = None
    live_peak_step: int | None = None  # the step it was sampled in
    last_eval: Mapping[str, Any] | None = None  # the last `evaluate` (--eval-every): {"step": N, metric: value, ...}


@dataclass(frozen=True, kw_only=True)
class RunResult:
    """A whole run: every rank plus the aggregate, as written to `result.json`."""

    run_id: str
    run_dir: str
    workload: str
    world_size: int
    num_nodes: int
    device: str
    strategy: str
    precision: str
    # ok | failed (results.table.status_text says "ok, no steps reported"); read with no
    # result.json: running (its dlaunch lives) | orphaned (it died before writing one)
    status: str
    exit_code: int
    wall_time_s: float
    samples_per_s: float
    units_per_s: float
    sample_units: str
    step_time_median_s: float
    slowest_rank: int | None
    data_wait_share: float
    ranks: tuple[RankResult, ...]
    failures: tuple[str, ...] = ()
    unreadable: tuple[str, ...] = ()  # rank files that could not be read, and why
    exposed_comm_s: float | None = None  # median over ranks, per step
    tp_comm_s: float | None = None  # median over ranks, per step: tensor parallelism's collectives
    busbw_gb_s: float | None = None
    stragglers: tuple[int, ...] = ()  # slow ranks (results.verdict.detect_stragglers)
    # one per straggler: {"rank", "rule", "rank_s", "median_s", "evidence", ...}: the rule's numbers
    straggler_evidence: tuple[Mapping[str, Any], ...] = ()
    verdict: Mapping[str, Any] | None = None  # the bottleneck: {"name", "evidence", "shares"}
    # attempts the rank files record (--max-restarts, SLURM requeues); the per-rank numbers are the last one's
    attempts: int = 1
    # how samples_per_s was measured: "wall clock" (global samples over the steady steps / the
    # wall time from the end of warm-up to the end of the last step, the slowest rank's) or
    # "step time" (rank files without step end times: samples / summed step times per rank)
    throughput_basis: str = "step time"
    prediction: Mapping[str, Any] | None = None  # plan.json against measured: results.prediction.compare's block
    # load average and CPU steal of each host at the run's start and end (results.plausibility)
    host_load: tuple[Mapping[str, Any], ...] = ()
    # implausible numbers (noisy steps, a prediction missed by > 2x, a busy host), one line each
    warnings: tuple[str, ...] = ()
    last_eval: Mapping[str, Any] | None = None  # the last evaluation (--eval-every), averaged over ranks
    offload: bool = False  # FSDP's CPU offload (the strategy's `offload`)
    float8: str = "none"  # float8 training's recipe (the strategy's `float8`)
    reduce_dtype: str = "fp32"  # what the gradients crossed the ranks in (the strategy's `reduce_dtype`)
    fsdp_unit: str = "block"  # FSDP's unit of gathering (the strategy's `fsdp_unit`)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunResult:
        """Rebuild a `to_dict` result; ValueError naming the first key of the wrong shape."""
        problem = dataclass_problem(cls, data) or next((f"rank {i}: {p}" for i, r in enumerate(data.get("ranks", ()))
                                                        if (p := dataclass_problem(RankResult, r)) is not None), None)
        if problem is not None:
            raise ValueError(f"not a dlaunch result: {problem}")
        d = dict(data)
        d["ranks"] = tuple(RankResult(**{**r, "log_tail": tuple(r.get("log_tail", ())),
                                         "top_ops": tuple(r.get("top_ops", ()))}) for r in d.get("ranks", ()))
        for key in ("failures", "unreadable", "stragglers", "straggler_evidence", "host_load", "warnings"):
            d[key] = tuple(d.get(key, ()))
        return cls(**d)

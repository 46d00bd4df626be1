"""The training loop every workload runs under: data, precision, accumulation, measurement.

Measurement never syncs the host with the device per step (runtime.window). Besides `step`, the
harness writes these records to the rank file:
  comm             exposed communication and busbw, measured after the last step of a
                   multi-rank run (runtime.calibrate); a failure there never fails the run
  wrap             strategy, compiled, mesh_shape (FSDP's device mesh; [replicas, shards] for hybrid;
                   with tensor parallelism [dp, tp] or [replicas, shards, tp]), mesh_dims (their
                   names), tp, dp (the tensor- and data-parallel degrees)
  compile          graphs, graph_breaks, break_reasons, recompiles, recompile_reasons, fallback
  profile          trace, top_ops [{name, self_s, per_step_ms, share, calls, calls_per_step}],
                   profiled_steps, by, device_time_s (CUDA); profiled steps carry profiled=true
  memory_snapshot  path, reason (end of run | out of memory)
  resume, checkpoint   see runtime.resume (--checkpoint-every, DLAUNCH_RESUME, preemption)

The optimizer and LR scheduler are the workload's (runtime.wrap.make_optimizer); the scheduler
steps once per optimizer step. `--eval-every N` runs the workload's `evaluate` after every Nth
step (runtime.evaluation).

Every step beats the heartbeat (`recorder.progress`, no device sync); a rank that fails inside
a window still records the steps it completed (with its own loss: `loss_scope: "rank"`). A NaN
or infinite loss is noticed when its window closes: a warning and `nonfinite_loss` {step, loss}
in the rank summary, or with --stop-on-nan `NonFiniteLoss` at that window's end.

`train` runs in three parts: `_setup` builds what a run needs in an order that keeps runs
reproducible, `_loop` trains, and `_finish` adds the records made after the last step.

Never imports cli, backends, jobs or report; torch at module level (see runtime/__init__).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from launcher.runspec import LaunchSpec
from launcher.runtime import calibrate, evaluation, profiling, resume
from launcher.runtime.build import build, fill
from launcher.runtime.compiling import CompileGuard, compile_stats
from launcher.runtime.context import RankContext
from launcher.runtime.live_bytes import StepSampler
from launcher.runtime.loader import fetch, make_loader
from launcher.runtime.preemption import Preemption, under_slurm
from launcher.runtime.recorder import RankRecorder
from launcher.runtime.window import FLUSH_INTERVAL_S, Clock, Window, peak_reset_step, window_steps
from launcher.runtime.wrap import Wrapped, make_optimizer, wrap
from launcher.specs import DDP_KINDS
from launcher.workload import Workload

log = logging.getLogger(__name__)

__all__ = ["FLUSH_INTERVAL_S", "train", "window_steps"]

SNAPSHOT_BUSY = "writing the memory snapshot"  # what the heartbeat says while it is written


def _autocast(spec: LaunchSpec, ctx: RankContext) -> contextlib.AbstractContextManager[Any]:
    # FSDP2's MixedPrecisionPolicy already computes in the low dtype; autocast is for DDP and zero1
    if spec.precision == "fp32" or spec.strategy not in DDP_KINDS:
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if spec.precision == "bf16" else torch.float16
    return torch.autocast(device_type=ctx.device_type, dtype=dtype)


def train(workload: Workload, spec: LaunchSpec, ctx: RankContext, recorder: RankRecorder) -> resume.Outcome:
    """Build, wrap and train the workload for `spec.steps` optimizer steps, recording each (see
    runtime.resume for resume and preemption). With `--memory-snapshot` the CUDA allocation
    history is dumped at the end, or on out of memory (then re-raised)."""
    if spec.detect_anomaly:
        profiling.enable_anomaly_detection(ctx.rank, dtensors=spec.tp > 1)
    if not spec.memory_snapshot:
        return _train(workload, spec, ctx, recorder)
    profiling.start_memory_history()
    try:
        outcome = _train(workload, spec, ctx, recorder)
    except torch.OutOfMemoryError:
        recorder.add(profiling.dump_memory_snapshot(spec.run_dir, ctx.rank, reason="out of memory",
                                                    busy=recorder.busy(SNAPSHOT_BUSY)))
        raise
    recorder.add(profiling.dump_memory_snapshot(spec.run_dir, ctx.rank, reason="end of run",
                                                busy=recorder.busy(SNAPSHOT_BUSY)))
    return outcome


def _train(workload: Workload, spec: LaunchSpec, ctx: RankContext, recorder: RankRecorder) -> resume.Outcome:
    run = _setup(workload, spec, ctx, recorder)
    end = _loop(run, workload, spec, ctx, recorder)
    outcome = _finish(run, end, workload, spec, ctx, recorder)
    # the loader's workers stop now (its iterator goes with `run`), not at interpreter exit
    del run
    return outcome


@dataclass(frozen=True, kw_only=True)
class _Setup:
    """What `_setup` made for the loop and the finish."""

    model: torch.nn.Module  # as the workload built it (inside DDP's wrapper): evaluated as is
    wrapped: Wrapped
    params: list[torch.nn.Parameter]  # the trainable ones: clipped, and sized by the calibration
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler | None
    scaler: torch.amp.GradScaler
    fp16: bool  # loss scaling is fp16's alone (the scaler is enabled)
    start: int  # the last step a resumed checkpoint covers; 0 for a fresh start
    device: torch.device
    loader: DataLoader[Any]
    batches: Iterator[Any]  # `loader`'s, from the step after `start` on
    clock: Clock
    guard: CompileGuard
    profiler: profiling.StepProfiler | None
    sampler: StepSampler
    window: Window

    def zero_grad(self) -> None:
        """Drop the gradients (after a step, or a failed compiled pass's partial ones)."""
        self.optimizer.zero_grad(set_to_none=True)


@dataclass(frozen=True, kw_only=True)
class _LoopEnd:
    stopped_at: int  # the step after which a preemption request stopped training; 0 if none did
    held: list[Any]  # the micro-batches of the latest step (the calibration replays them)
    nonfinite: dict[str, Any] | None  # the first step whose loss was NaN or inf
    last_eval: dict[str, Any] | None  # {step, metric: value} of the last evaluation


def _setup(workload: Workload, spec: LaunchSpec, ctx: RankContext, recorder: RankRecorder) -> _Setup:
    """Build, wrap, make the optimizer, resume, open the loader and the step's instruments, then
    freeze what was made for the garbage collector. The order is part of the result: the seed
    before the model, the optimizer after wrapping, the checkpoint before the loader."""
    evaluation.check(workload, spec)
    device = ctx.device()
    torch.manual_seed(spec.seed)
    # sharded over several ranks: built on rank 0, the other ranks' modules on the meta device until `fill`
    model, values = build(workload, spec.parallel, ctx)
    if not spec.parallel.shards_params:
        # FSDP's fully_shard moves each unit to the device as it shards it (torch's _move_states_to_device):
        # the whole fp32 model on one GPU first would cap FSDP and offload at the models that need neither
        model = model.to(device)
    blocks = workload.blocks(model)
    tp = spec.tp
    # the workload's plan for its model as built (module names before any wrapper)
    plan = workload.tp_plan(model, tp) if tp > 1 else None
    wrapped = wrap(model, spec.parallel, ctx, blocks, shard_group_size=spec.shard_group_size, tp_plan=plan)
    fill(model, values, spec.parallel, ctx)
    del values  # rank 0's whole model, now in every rank's shards
    recorder.add({"kind": "wrap", "strategy": spec.strategy, "compiled": wrapped.compiled,
                  "mesh_shape": list(wrapped.mesh_shape) if wrapped.mesh_shape else None,
                  "mesh_dims": list(wrapped.mesh_dims) if wrapped.mesh_dims else None,
                  "tp": tp, "dp": ctx.world_size // tp,
                  **({"float8": wrapped.float8} if wrapped.float8 else {})})
    params = [p for p in wrapped.module.parameters() if p.requires_grad]
    optimizer, scheduler = make_optimizer(workload, model, ctx, spec.parallel)
    scaler = torch.amp.GradScaler(ctx.device_type, enabled=spec.parallel.uses_grad_scaler)
    # after wrapping (DCP loads DDP and FSDP2 state alike) and before the loader (data position)
    start = resume.resume(wrapped.module, optimizer, scaler, spec, ctx, recorder, scheduler=scheduler)
    loader = make_loader(workload, spec, ctx, start_step=start)
    batches = iter(loader)
    clock = Clock(ctx.device_type)
    profiler = None
    if spec.profile:
        # the profiler counts this attempt's steps (a resumed run starts after `start`)
        profiler = profiling.StepProfiler(run_dir=spec.run_dir, rank=ctx.rank, warmup_steps=spec.warmup_steps,
                                          steps=spec.steps - start, cuda=ctx.device_type == "cuda")
    sampler = StepSampler.for_rank(device_type=ctx.device_type, start=start, warmup_steps=spec.warmup_steps,
                                   steps=spec.steps, module=wrapped.module, optimizer=optimizer)
    window = Window(clock, ctx, recorder, scaler, device, spec.log_every,
                    steady_from=peak_reset_step(start, spec.warmup_steps))
    run = _Setup(model=model, wrapped=wrapped, params=params, optimizer=optimizer, scheduler=scheduler,
                 scaler=scaler, fp16=scaler.is_enabled(), start=start, device=device, loader=loader,
                 batches=batches, clock=clock, profiler=profiler, sampler=sampler, window=window,
                 guard=CompileGuard(compiled=wrapped.compiled, strict=spec.compile_strict, rank=ctx.rank))
    if not gc.isenabled():  # the rank's entry left it off for the setup
        # what setup made lives for the whole run: frozen, no collection during training
        # rescans it, and collections run as usual on what training itself makes
        gc.freeze()
        gc.enable()
    return run


def _forward_backward(run: _Setup, workload: Workload, spec: LaunchSpec, ctx: RankContext,
                      micro_batches: list[Any]) -> torch.Tensor:
    """One optimizer step's micro-batches, syncing only on the last; the summed loss. The hot
    path adds nothing unneeded: no GradScaler call unless fp16, no division without accumulation."""
    accum = spec.grad_accum
    step_loss: torch.Tensor | None = None
    for micro, batch in enumerate(micro_batches):
        sync = contextlib.nullcontext() if micro == accum - 1 else run.wrapped.accumulate()
        with sync, run.wrapped.loss_context():
            with _autocast(spec, ctx):
                loss = workload.loss_fn(run.wrapped.module, batch)
            if accum > 1:
                loss = loss / accum
            (run.scaler.scale(loss) if run.fp16 else loss).backward()
        done = loss.detach()
        # a loss over vocabulary-split logits (TP's loss parallel) is a DTensor: its whole value
        done = done.full_tensor() if hasattr(done, "full_tensor") else done
        step_loss = done if step_loss is None else step_loss + done
    assert step_loss is not None  # a step has at least one micro-batch (accumulation >= 1)
    return step_loss


def _loop(run: _Setup, workload: Workload, spec: LaunchSpec, ctx: RankContext, recorder: RankRecorder) -> _LoopEnd:
    """Train the steps after `run.start`, or until a preemption request stops all at a window's end."""
    # this rank's share: the tp ranks of one group train on the same samples, so each counts
    # 1/tp of them and the sum over ranks is the job's throughput
    samples: int = spec.micro_batch * spec.grad_accum
    samples_per_step = samples / spec.tp if spec.tp > 1 else samples
    units_per_step = samples_per_step * workload.units_per_sample
    # compilation happens at the first calls: watch them through warm-up (at least one step)
    watch_until = run.start + max(1, spec.warmup_steps)
    clock, window, sampler, guard, profiler = run.clock, run.window, run.sampler, run.guard, run.profiler
    stopped_at = 0  # these four are _LoopEnd's fields
    held: list[Any] = []
    nonfinite: dict[str, Any] | None = None
    last_eval: dict[str, Any] | None = None
    with Preemption(sigterm=under_slurm()) as preemption:
        try:
            for step in range(run.start + 1, spec.steps + 1):
                window.begin(step)
                step_start = clock.start()
                sampler.begin(step)
                # the step's batches first: the forward+backward mark then times compute and
                # gradient sync alone (runtime.calibrate); a compile failure re-runs them eagerly
                held, data_wait = fetch(run.batches, spec.grad_accum, run.device, clock)
                fwd_bwd_start = clock.start()
                if guard.watching:
                    step_loss = guard.run(lambda: _forward_backward(run, workload, spec, ctx, held), run.zero_grad)
                    if step >= watch_until:
                        guard.stop()
                else:
                    step_loss = _forward_backward(run, workload, spec, ctx, held)
                fwd_bwd_mark = clock.stop(fwd_bwd_start)
                if spec.max_grad_norm > 0:
                    # once per optimizer step, on true (unscaled) gradients
                    run.scaler.unscale_(run.optimizer)
                    torch.nn.utils.clip_grad_norm_(run.params, spec.max_grad_norm)
                run.scaler.step(run.optimizer)
                run.scaler.update()
                if run.scheduler is not None:
                    run.scheduler.step()
                run.zero_grad()
                mark = clock.stop(step_start)
                end_time = time.time()
                evaluated: dict[str, Any] = {}
                if evaluation.due(step, spec, workload):
                    # outside the step's time; its wall time counts between steps (eval_s)
                    metrics, eval_s = evaluation.evaluate(workload, run.model, ctx)
                    evaluated = {"eval": metrics, "eval_s": eval_s}
                    last_eval = {"step": step, **metrics}
                # warm-up counts from this attempt's first step: a resumed rank is cold again
                record = {"kind": "step", "step": step, "end_time": end_time, "data_wait_s": data_wait,
                          "samples": samples_per_step, "units": units_per_step,
                          "warmup": step - run.start <= spec.warmup_steps, **evaluated}
                sampler.end(step, record)
                if profiler is not None:
                    profiler.step()
                    # profiled steps run slower: aggregate leaves them out of throughput
                    record["profiled"] = profiler.profiled(step - run.start)
                window.add(record, mark, step_loss, fwd_bwd_mark)
                recorder.progress(step)  # hang watcher: every step, a small file a second at most
                boundary = resume.window_boundary(step, spec)
                if window.full or step == spec.steps or boundary:
                    closing = window.records  # close() fills in their rank-averaged losses
                    stop_any = window.close(stop=preemption.requested)
                    nonfinite = nonfinite or _check_losses(closing, spec, ctx)
                    if stop_any or boundary:
                        # a stop: every rank learnt it from the same all-reduce, all save here
                        resume.save(step, run.wrapped.module, run.optimizer, run.scaler, spec, ctx, recorder,
                                    reason="preempted" if stop_any else "periodic", scheduler=run.scheduler)
                    if stop_any:
                        stopped_at = step
                        break
        except BaseException:
            sampler.abort()
            window.flush_open()
            raise
    return _LoopEnd(stopped_at=stopped_at, held=held, nonfinite=nonfinite, last_eval=last_eval)


def _finish(run: _Setup, end: _LoopEnd, workload: Workload, spec: LaunchSpec, ctx: RankContext,
            recorder: RankRecorder) -> resume.Outcome:
    """After the last step: the profile, compile and comm records, flushed; how the run ended
    (`resume.outcome`, with the first non-finite loss and the last evaluation in its summary)."""
    if run.profiler is not None:
        recorder.add(run.profiler.close())
    if run.wrapped.compiled:
        recorder.add(compile_stats(run.guard.fallback))
    if ctx.is_distributed and spec.calibrate and not end.stopped_at and run.window.fwd_bwd_times():
        # after the last step: training never waits for it and is unchanged by it
        recorder.add(calibrate.comm_record(
            run.window, run.wrapped, lambda: _forward_backward(run, workload, spec, ctx, end.held),
            run.zero_grad, run.params, ctx, tp=spec.tp))
    recorder.flush()
    outcome = resume.outcome(end.stopped_at, spec)
    extra = {k: v for k, v in (("nonfinite_loss", end.nonfinite), ("eval", end.last_eval)) if v is not None}
    if not extra:
        return outcome
    return dataclasses.replace(outcome, summary={**outcome.summary, **extra})


class NonFiniteLoss(RuntimeError):
    """--stop-on-nan: a step's loss (averaged over ranks) was NaN or infinite."""


def _check_losses(records: list[dict[str, Any]], spec: LaunchSpec, ctx: RankContext) -> dict[str, Any] | None:
    """The first step of a closed window whose loss is not finite, as {step, loss}, or None. The
    losses are rank-averaged (no extra sync), so with --stop-on-nan every rank raises at the same
    step, before a checkpoint of the broken state is saved."""
    bad = next((r for r in records if not math.isfinite(r["loss"])), None)
    if bad is None:
        return None
    found = {"step": int(bad["step"]), "loss": str(bad["loss"])}
    if spec.stop_on_nan:
        raise NonFiniteLoss(f"the loss is {found['loss']} at step {found['step']}; "
                            "--stop-on-nan ended the run")
    if ctx.rank == 0:
        log.warning("the loss is %s at step %d (averaged over ranks); training goes on "
                    "(--stop-on-nan stops at the first one)", found["loss"], found["step"])
    return found


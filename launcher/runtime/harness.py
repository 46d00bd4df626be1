"""The training loop every workload runs under: data, precision, accumulation, measurement.

Measurement never syncs the host with the device per step: on CUDA each step is bracketed by
events that are read at the end of a logging window; losses stay tensors until then (see
runtime.window). On CPU the step is synchronous anyway, so `perf_counter` is exact.

Besides `step` and `comm`, the harness writes these records to the rank file:
  wrap             strategy, compiled, mesh_shape (FSDP's device mesh; [replicas, shards] for hybrid)
  compile          graphs, graph_breaks, break_reasons, recompiles, recompile_reasons, fallback
  profile          trace, top_ops [{name, self_s, per_step_ms, share, calls, calls_per_step}],
                   profiled_steps, by, device_time_s (CUDA); profiled steps carry profiled=true
  memory_snapshot  path, reason (end of run | out of memory)
  resume, checkpoint   see runtime.resume (--checkpoint-every, DLAUNCH_RESUME, preemption)

Every step beats the heartbeat (`recorder.progress`, no device sync) so the launcher's hang
watcher sees progress even inside a long window; a rank that fails inside a window still
records the steps it completed (with its own loss: `loss_scope: "rank"`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable
from typing import Any

from launcher.runtime import resume
from launcher.runtime.compiling import CompileGuard, compile_stats
from launcher.runtime.context import RankContext
from launcher.runtime.recorder import RankRecorder
from launcher.runtime.window import FLUSH_INTERVAL_S, Clock, Window, window_steps
from launcher.runtime.wrap import Wrapped, wrap
from launcher.specs import LaunchSpec
from launcher.workload import Workload

log = logging.getLogger(__name__)

__all__ = ["FLUSH_INTERVAL_S", "make_loader", "to_device", "train", "window_steps"]

def to_device(batch: Any, device: Any) -> Any:
    """Move a batch (tensor, or tuple / list / dict of them) to `device`."""
    import torch

    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, tuple | list):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def make_loader(workload: Workload, spec: LaunchSpec, ctx: RankContext, *,
                start_step: int = 0) -> Any:
    """A DataLoader over exactly the samples this rank trains on, in a fixed order.

    The dataset holds steps x global batch samples; DistributedSampler hands rank r every
    world_size-th index, so the union of all ranks' micro-batches at a step is the batch one
    process would see with world_size times the micro-batch (the equivalence the tests check).
    After a resume at `start_step` the index list starts where step start_step + 1 begins.
    """
    import torch
    from torch.utils.data import DataLoader, DistributedSampler

    dataset = workload.make_dataset(spec.steps * spec.global_batch)
    sampler = DistributedSampler(dataset, num_replicas=ctx.world_size, rank=ctx.rank,
                                 shuffle=spec.loader.shuffle, seed=spec.seed, drop_last=True)
    if start_step:
        sampler = resume.SkipSampler(sampler, start_step * spec.micro_batch * spec.grad_accum_steps)
    workers = spec.loader.num_workers
    return DataLoader(
        dataset, batch_size=spec.micro_batch, sampler=sampler, drop_last=True,
        num_workers=workers,
        pin_memory=spec.loader.pin_memory and ctx.device_type == "cuda",
        persistent_workers=spec.loader.persistent_workers and workers > 0,
        prefetch_factor=spec.loader.prefetch_factor if workers > 0 else None,
        generator=torch.Generator().manual_seed(spec.seed),
    )


def _autocast(spec: LaunchSpec, ctx: RankContext) -> contextlib.AbstractContextManager[Any]:
    import torch

    # FSDP2's MixedPrecisionPolicy already computes in the low dtype; autocast is for DDP
    if spec.strategy.precision == "fp32" or spec.strategy.kind != "ddp":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if spec.strategy.precision == "bf16" else torch.float16
    return torch.autocast(device_type=ctx.device_type, dtype=dtype)


def train(workload: Workload, spec: LaunchSpec, ctx: RankContext,
          recorder: RankRecorder) -> resume.Outcome:
    """Build, wrap and train the workload for `spec.steps` optimizer steps, recording each.

    Resumes from the last checkpoint with DLAUNCH_RESUME=1 and stops early (status
    `preempted`) on the preemption signal; see runtime.resume. With `--memory-snapshot` the
    CUDA allocation history is dumped at the end, or when the rank runs out of memory (then the
    error is raised again).
    """
    import torch

    from launcher.runtime import profiling

    if spec.detect_anomaly:
        profiling.enable_anomaly_detection(ctx.rank)
    if not spec.memory_snapshot:
        return _train(workload, spec, ctx, recorder)
    profiling.start_memory_history()
    try:
        outcome = _train(workload, spec, ctx, recorder)
    except torch.OutOfMemoryError:
        recorder.add(profiling.dump_memory_snapshot(spec.run_dir, ctx.rank, reason="out of memory"))
        raise
    recorder.add(profiling.dump_memory_snapshot(spec.run_dir, ctx.rank, reason="end of run"))
    return outcome


def _train(workload: Workload, spec: LaunchSpec, ctx: RankContext,
           recorder: RankRecorder) -> resume.Outcome:
    import torch

    device = ctx.device()
    torch.manual_seed(spec.seed)
    model = workload.build_model().to(device)
    blocks = workload.blocks(model)
    wrapped: Wrapped = wrap(model, spec.strategy, ctx, blocks, shard_group_size=spec.shard_group_size)
    recorder.add({"kind": "wrap", "strategy": spec.strategy.kind, "compiled": wrapped.compiled,
                  "mesh_shape": list(wrapped.mesh_shape) if wrapped.mesh_shape else None})
    params = [p for p in wrapped.module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3, fused=ctx.device_type == "cuda")
    scaler = torch.amp.GradScaler(ctx.device_type, enabled=spec.strategy.uses_grad_scaler)
    # after wrapping (DCP loads DDP and FSDP2 state alike) and before the loader (data position)
    start = resume.resume(wrapped.module, optimizer, scaler, spec, ctx, recorder)
    loader = make_loader(workload, spec, ctx, start_step=start)
    batches = iter(loader)
    clock = Clock(ctx.device_type)
    accum = spec.grad_accum_steps
    samples_per_step = spec.micro_batch * accum
    units_per_step = samples_per_step * workload.units_per_sample
    # compilation happens at the first calls: watch them through warm-up (at least one step)
    guard = CompileGuard(compiled=wrapped.compiled, strict=spec.strategy.compile_strict,
                         rank=ctx.rank)
    watch_until = start + max(1, spec.warmup_steps)

    def zero_grad() -> None:
        optimizer.zero_grad(set_to_none=True)

    def forward_backward(micro_batches: Iterable[Any]) -> Any:
        """One optimizer step's micro-batches; sync only on the last; the summed loss."""
        step_loss = torch.zeros((), device=device)
        for micro, batch in enumerate(micro_batches):
            sync = contextlib.nullcontext() if micro == accum - 1 else wrapped.accumulate()
            with sync:
                with _autocast(spec, ctx):
                    loss = workload.loss_fn(wrapped.module, batch) / accum
                scaler.scale(loss).backward()
            step_loss += loss.detach()
        return step_loss

    if ctx.is_distributed and spec.calibrate_comm:
        _calibrate(workload, wrapped, spec, ctx, loader, recorder, params, guard)

    profiler = None
    if spec.profile:
        from launcher.runtime.profiling import StepProfiler

        # the profiler counts this attempt's steps (a resumed run starts after `start`)
        profiler = StepProfiler(run_dir=spec.run_dir, rank=ctx.rank, warmup_steps=spec.warmup_steps,
                                steps=spec.steps - start, cuda=ctx.device_type == "cuda")

    window = Window(clock, ctx, recorder, scaler, device, spec.log_every)
    stopped_at = 0  # the step after which a preemption request stopped training
    with resume.Preemption(sigterm=resume.under_slurm()) as preemption:
        try:
            for step in range(start + 1, spec.steps + 1):
                step_start = clock.start()
                data_wait = 0.0

                def fetch() -> Any:
                    nonlocal data_wait
                    t = time.perf_counter()
                    batch = to_device(next(batches), device)
                    data_wait += time.perf_counter() - t
                    return batch

                if guard.watching:
                    # keep the step's batches: a compile failure re-runs them eagerly
                    held = [fetch() for _ in range(accum)]
                    step_loss = guard.run(lambda: forward_backward(held), zero_grad)
                    if step >= watch_until:
                        guard.stop()
                else:
                    step_loss = forward_backward(fetch() for _ in range(accum))
                if spec.max_grad_norm > 0:
                    # once per optimizer step, on true (unscaled) gradients
                    scaler.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_(params, spec.max_grad_norm)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                mark = clock.stop(step_start)
                # warm-up counts from this attempt's first step: a resumed rank is cold again
                record = {"kind": "step", "step": step, "end_time": time.time(),
                          "data_wait_s": data_wait, "samples": samples_per_step,
                          "units": units_per_step, "warmup": step - start <= spec.warmup_steps}
                if profiler is not None:
                    profiler.step()
                    # profiled steps run slower: aggregate leaves them out of throughput
                    record["profiled"] = profiler.profiled(step - start)
                window.add(record, mark, step_loss)
                recorder.progress(step)  # hang watcher: every step, a small file a second at most
                boundary = resume.window_boundary(step, spec)
                if window.full or step == spec.steps or boundary:
                    if window.close(stop=preemption.requested):
                        # every rank learnt it from the same all-reduce: all save at this step
                        resume.save_preempted(step, wrapped.module, optimizer, scaler, spec,
                                              ctx, recorder)
                        stopped_at = step
                        break
                    if boundary:
                        resume.save(step, wrapped.module, optimizer, scaler, spec, recorder,
                                    reason="periodic")
        except BaseException:
            window.flush_open()
            raise
    if profiler is not None:
        recorder.add(profiler.close())
    if wrapped.compiled:
        recorder.add(compile_stats(guard.fallback))
    recorder.flush()
    batches = loader = None  # stop the loader's workers now, not at interpreter exit
    return resume.outcome(stopped_at, spec)


def _calibrate(workload: Workload, wrapped: Wrapped, spec: LaunchSpec, ctx: RankContext,
               loader: Any, recorder: RankRecorder, params: list[Any], guard: CompileGuard) -> None:
    """Measure exposed communication and all-reduce bandwidth; see runtime.calibrate."""
    import torch

    from launcher.runtime.calibrate import allreduce_bandwidth, exposed_comm

    device = ctx.device()
    batch = to_device(next(iter(loader)), device)

    def forward_backward() -> None:
        with _autocast(spec, ctx):
            loss = workload.loss_fn(wrapped.module, batch)
        loss.backward()

    def zero_grad() -> None:
        for p in params:
            p.grad = None

    record: dict[str, Any] = {"kind": "comm"}
    devices = [ctx.local_rank] if ctx.device_type == "cuda" else []
    # training must not depend on whether calibration ran: keep the RNG streams untouched
    with torch.random.fork_rng(devices=devices):
        # the first sync-on pass builds buckets and compiles (falling back to eager on failure)
        guard.run(forward_backward, zero_grad)
        zero_grad()
        record.update(exposed_comm(forward_backward, wrapped.no_sync, zero_grad,
                                   cuda=ctx.device_type == "cuda"))
    grad_bytes = sum(p.numel() * 4 for p in params)
    record.update(allreduce_bandwidth(grad_bytes, device, ctx.world_size))
    recorder.add(record)

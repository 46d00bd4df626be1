"""The training loop every workload runs under: data, precision, accumulation, measurement.

Measurement never syncs the host with the device per step: on CUDA each step is bracketed by
events that are read at the end of a logging window; losses stay tensors until then. On CPU
the step is synchronous anyway, so `perf_counter` is exact.

Besides `step` and `comm`, the harness writes these records to the rank file:
  wrap             strategy, compiled, mesh_shape (FSDP's device mesh; [replicas, shards] for hybrid)
  compile          graphs, graph_breaks, break_reasons, recompiles, recompile_reasons, fallback
  profile          trace, top_ops [{name, self_s, per_step_ms, share, calls, calls_per_step}],
                   profiled_steps, by, device_time_s (CUDA); profiled steps carry profiled=true
  memory_snapshot  path, reason (end of run | out of memory)
"""

from __future__ import annotations

import contextlib
import logging
import resource
import sys
import time
from collections.abc import Iterable
from typing import Any

from launcher.runtime.compiling import CompileGuard, compile_stats
from launcher.runtime.context import RankContext
from launcher.runtime.recorder import RankRecorder
from launcher.runtime.wrap import Wrapped, wrap
from launcher.specs import LaunchSpec
from launcher.workload import Workload

log = logging.getLogger(__name__)

# flush about this often even when --log-every steps take longer, so a killed rank loses little
FLUSH_INTERVAL_S = 5.0


def window_steps(mean_step_s: float, log_every: int) -> int:
    """Steps in the next logging window: --log-every, fewer when that would exceed the flush
    interval. Every rank must close its window at the same step (the loss all-reduce is a
    collective), so the length comes from the previous window's rank-averaged step time, which
    all ranks share, never from each rank's own clock."""
    if mean_step_s <= 0:
        return log_every
    return max(1, min(log_every, int(FLUSH_INTERVAL_S / mean_step_s)))


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


def make_loader(workload: Workload, spec: LaunchSpec, ctx: RankContext) -> Any:
    """A DataLoader over exactly the samples this rank trains on, in a fixed order.

    The dataset holds steps x global batch samples; DistributedSampler hands rank r every
    world_size-th index, so the union of all ranks' micro-batches at a step is the batch one
    process would see with world_size times the micro-batch (the equivalence the tests check).
    """
    import torch
    from torch.utils.data import DataLoader, DistributedSampler

    dataset = workload.make_dataset(spec.steps * spec.global_batch)
    sampler = DistributedSampler(dataset, num_replicas=ctx.world_size, rank=ctx.rank,
                                 shuffle=spec.loader.shuffle, seed=spec.seed, drop_last=True)
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


class _Clock:
    """Step timing: CUDA events read lazily, or perf_counter on CPU."""

    def __init__(self, device_type: str) -> None:
        import torch

        self.cuda = device_type == "cuda"
        self._torch = torch
        self._pending: list[tuple[Any, Any]] = []
        self._t0 = 0.0

    def start(self) -> Any:
        if self.cuda:
            ev = self._torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, start: Any) -> Any:
        if self.cuda:
            ev = self._torch.cuda.Event(enable_timing=True)
            ev.record()
            return (start, ev)
        return time.perf_counter() - start

    def resolve(self, marks: list[Any]) -> list[float]:
        """Seconds per step; on CUDA this is the one host sync of the window."""
        if not self.cuda:
            return list(marks)
        self._torch.cuda.synchronize()
        return [a.elapsed_time(b) / 1000.0 for a, b in marks]


def _peak_mem_bytes(device_type: str) -> int:
    if device_type == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated())
    # CPU: peak resident set of this process (ru_maxrss is KiB on Linux)
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def train(workload: Workload, spec: LaunchSpec, ctx: RankContext, recorder: RankRecorder) -> None:
    """Build, wrap and train the workload for `spec.steps` optimizer steps, recording each.

    With `--memory-snapshot` the CUDA allocation history is dumped at the end, or when the
    rank runs out of memory (then the error is raised again).
    """
    import torch

    from launcher.runtime import profiling

    if spec.detect_anomaly:
        profiling.enable_anomaly_detection(ctx.rank)
    if not spec.memory_snapshot:
        _train(workload, spec, ctx, recorder)
        return
    profiling.start_memory_history()
    try:
        _train(workload, spec, ctx, recorder)
    except torch.OutOfMemoryError:
        recorder.add(profiling.dump_memory_snapshot(spec.run_dir, ctx.rank, reason="out of memory"))
        raise
    recorder.add(profiling.dump_memory_snapshot(spec.run_dir, ctx.rank, reason="end of run"))


def _train(workload: Workload, spec: LaunchSpec, ctx: RankContext, recorder: RankRecorder) -> None:
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
    loader = make_loader(workload, spec, ctx)
    batches = iter(loader)
    clock = _Clock(ctx.device_type)
    accum = spec.grad_accum_steps
    samples_per_step = spec.micro_batch * accum
    units_per_step = samples_per_step * workload.units_per_sample
    # compilation happens at the first calls: watch them through warm-up (at least step 1)
    guard = CompileGuard(compiled=wrapped.compiled, strict=spec.strategy.compile_strict,
                         rank=ctx.rank)
    watch_until = max(1, spec.warmup_steps)

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

        profiler = StepProfiler(run_dir=spec.run_dir, rank=ctx.rank, warmup_steps=spec.warmup_steps,
                                steps=spec.steps, cuda=ctx.device_type == "cuda")

    window: list[dict[str, Any]] = []
    marks: list[Any] = []
    losses: list[Any] = []
    scales: list[Any] = []
    # the scale tensor is created lazily by the first scale(); start from the initial value
    prev_scale = [torch.tensor(scaler.get_scale(), device=device)] if scaler.is_enabled() else []
    window_len = 1  # the first window is step 1 alone: it measures the step time
    for step in range(1, spec.steps + 1):
        start = clock.start()
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
        marks.append(clock.stop(start))
        losses.append(step_loss)
        if scaler.is_enabled():
            # the scale drops exactly when the step was skipped for inf/NaN gradients;
            # keep a device copy and compare at the window's end (no sync here)
            scales.append(scaler._scale.detach().clone())
        record = {"kind": "step", "step": step, "end_time": time.time(), "data_wait_s": data_wait,
                  "samples": samples_per_step, "units": units_per_step,
                  "warmup": step <= spec.warmup_steps}
        if profiler is not None:
            profiler.step()
            # profiled steps run slower: aggregate leaves them out of throughput
            record["profiled"] = profiler.profiled(step)
        window.append(record)
        if len(window) >= window_len or step == spec.steps:
            mean_step_s = _close_window(window, marks, losses, clock, ctx, recorder,
                                        prev_scale + scales)
            window_len = window_steps(mean_step_s, spec.log_every)
            prev_scale = scales[-1:]
            window, marks, losses, scales = [], [], [], []
    if profiler is not None:
        recorder.add(profiler.close())
    if wrapped.compiled:
        recorder.add(compile_stats(guard.fallback))
    recorder.flush()
    del batches, loader


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


def _close_window(window: list[dict[str, Any]], marks: list[Any], losses: list[Any],
                  clock: _Clock, ctx: RankContext, recorder: RankRecorder,
                  scales: list[Any]) -> float:
    """Resolve the window's timings, losses and skipped steps (one sync) and record them.

    Returns the window's mean step time averaged over ranks (the same number on every rank).
    """
    import torch
    import torch.distributed as dist

    times = clock.resolve(marks)
    if scales:
        values = torch.stack(scales).float().tolist()
        for rec, before, after in zip(window, values, values[1:]):
            rec["skipped"] = after < before
    # the losses and, last, this rank's mean step time: one collective per window, not per step
    mean_step = torch.tensor([sum(times) / len(times)], device=losses[0].device)
    loss_vec = torch.cat([torch.stack(losses).float(), mean_step])
    if ctx.is_distributed:
        dist.all_reduce(loss_vec, op=dist.ReduceOp.SUM)
        loss_vec /= ctx.world_size
    *values, mean_step_s = loss_vec.tolist()
    peak = _peak_mem_bytes(ctx.device_type)
    now = time.time()
    for rec, step_time, loss in zip(window, times, values):
        rec.update(step_time_s=step_time, loss=loss, peak_mem_bytes=peak, time=now)
        recorder.add(rec)
    recorder.flush()
    sys.stdout.flush()
    return mean_step_s

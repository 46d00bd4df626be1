"""The training loop every workload runs under: data, precision, accumulation, measurement.

Measurement never syncs the host with the device per step: on CUDA each step is bracketed by
events that are read at the end of a logging window; losses stay tensors until then. On CPU
the step is synchronous anyway, so `perf_counter` is exact.
"""

from __future__ import annotations

import contextlib
import logging
import resource
import sys
import time
from typing import Any

from launcher.runtime.context import RankContext
from launcher.runtime.recorder import RankRecorder
from launcher.runtime.wrap import Wrapped, wrap
from launcher.specs import LaunchSpec
from launcher.workload import Workload

log = logging.getLogger(__name__)

# flush at least this often even inside a long logging window, so a killed rank loses little
FLUSH_INTERVAL_S = 5.0


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
    """Build, wrap and train the workload for `spec.steps` optimizer steps, recording each."""
    import torch

    device = ctx.device()
    torch.manual_seed(spec.seed)
    model = workload.build_model().to(device)
    blocks = workload.blocks(model)
    wrapped: Wrapped = wrap(model, spec.strategy, ctx, blocks)
    params = [p for p in wrapped.module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3, fused=ctx.device_type == "cuda")
    scaler = torch.amp.GradScaler(ctx.device_type, enabled=spec.strategy.uses_grad_scaler)
    loader = make_loader(workload, spec, ctx)
    batches = iter(loader)
    clock = _Clock(ctx.device_type)
    accum = spec.grad_accum_steps
    samples_per_step = spec.micro_batch * accum
    units_per_step = samples_per_step * workload.units_per_sample

    if ctx.is_distributed and spec.calibrate_comm:
        _calibrate(workload, wrapped, spec, ctx, loader, recorder, params)

    window: list[dict[str, Any]] = []
    marks: list[Any] = []
    losses: list[Any] = []
    scales: list[Any] = []
    # the scale tensor is created lazily by the first scale(); start from the initial value
    prev_scale = [torch.tensor(scaler.get_scale(), device=device)] if scaler.is_enabled() else []
    last_flush = time.monotonic()
    for step in range(1, spec.steps + 1):
        start = clock.start()
        data_wait = 0.0
        step_loss = torch.zeros((), device=device)
        for micro in range(accum):
            t = time.perf_counter()
            batch = to_device(next(batches), device)
            data_wait += time.perf_counter() - t
            sync = contextlib.nullcontext() if micro == accum - 1 else wrapped.accumulate()
            with sync:
                with _autocast(spec, ctx):
                    loss = workload.loss_fn(wrapped.module, batch) / accum
                scaler.scale(loss).backward()
            step_loss += loss.detach()
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
        window.append({"kind": "step", "step": step, "end_time": time.time(), "data_wait_s": data_wait,
                       "samples": samples_per_step, "units": units_per_step,
                       "warmup": step <= spec.warmup_steps})
        if step % spec.log_every == 0 or step == spec.steps or (
                time.monotonic() - last_flush > FLUSH_INTERVAL_S):
            _close_window(window, marks, losses, clock, ctx, recorder, prev_scale + scales)
            prev_scale = scales[-1:]
            window, marks, losses, scales = [], [], [], []
            last_flush = time.monotonic()
    del batches, loader


def _calibrate(workload: Workload, wrapped: Wrapped, spec: LaunchSpec, ctx: RankContext,
               loader: Any, recorder: RankRecorder, params: list[Any]) -> None:
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
        forward_backward()  # the first sync-on pass builds buckets / compiles
        zero_grad()
        record.update(exposed_comm(forward_backward, wrapped.no_sync, zero_grad,
                                   cuda=ctx.device_type == "cuda"))
    grad_bytes = sum(p.numel() * 4 for p in params)
    record.update(allreduce_bandwidth(grad_bytes, device, ctx.world_size))
    recorder.add(record)


def _close_window(window: list[dict[str, Any]], marks: list[Any], losses: list[Any],
                  clock: _Clock, ctx: RankContext, recorder: RankRecorder,
                  scales: list[Any]) -> None:
    """Resolve the window's timings, losses and skipped steps (one sync) and record them."""
    import torch
    import torch.distributed as dist

    times = clock.resolve(marks)
    if scales:
        values = torch.stack(scales).float().tolist()
        for rec, before, after in zip(window, values, values[1:]):
            rec["skipped"] = after < before
    loss_vec = torch.stack(losses).float()
    if ctx.is_distributed:
        # the global loss: one collective per window, not per step
        dist.all_reduce(loss_vec, op=dist.ReduceOp.SUM)
        loss_vec /= ctx.world_size
    values = loss_vec.tolist()
    peak = _peak_mem_bytes(ctx.device_type)
    now = time.time()
    for rec, step_time, loss in zip(window, times, values):
        rec.update(step_time_s=step_time, loss=loss, peak_mem_bytes=peak, time=now)
        recorder.add(rec)
    recorder.flush()
    sys.stdout.flush()

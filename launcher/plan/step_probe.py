"""Time training steps of the workload itself on this host's CPU: the anchor of CPU predictions.

When the ranks will run on the very CPU dlaunch plans on, the surest figure for their compute is a
measurement of it. Per-kind rates (`cpu_probe`) describe matmuls, attention and convolutions, but a
CPU step also spends its time in work no single rate describes: batch norm runs at ~2 GB/s in fp32
on one EPYC core and GELU at ~6, the CPU flash-attention kernel's bf16 backward takes 5x its forward
at 128 tokens and 2x at 2,048, autocast casts, the workload's own Python and its data loading. So
the model is built for real in the planning process (only when small: see MAX_STATE_BYTES and
BUDGET_S) and trained for a few steps with the thread count each rank will have, at micro-batch 1
and at the largest micro-batch the plan considers that its measured steps leave time for
(`scout_size`; not the analytic model's guess, which may be far off on an unseen CPU), in fp32 and
bf16 (autocast, as DDP runs it; for a model with batch norms also bf16 with those in fp32, as FSDP
runs it): data fetch, forward, backward and optimizer step timed apart (the median of REPEATS or
more, after warm-up). The CPU model (`cpu_cost`) takes compute from this (a fixed cost plus a cost
per sample through the two sizes) and adds what one process cannot show: time-sharing cores, FSDP's
own work and gloo's collectives. Micro-batch 1 alone scaled linearly read ResNet-18 at micro-batch
16 2.3x too slow (2 ranks: measured/predicted 0.43): a step's fixed cost and its threads' poor use
of one sample's small ops are paid once per step, not per sample.

Cached next to the profile, per workload (file, arguments, torch), host and thread count
(`resolve.cached_step_timing`). Never imports cli, backends, jobs, runtime or report; torch
only inside `measure_steps`.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import itertools
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from launcher.errors import PlanError
from launcher.specs import DDP_KINDS, check
from launcher.workload import Workload, batch_norms

# bump when `measure_steps` measures differently, so old cache entries are ignored (4: the
# second size scouted by measured steps, up to 16)
STEP_PROBE_FORMAT = 4
# a precision's timing with the model's batch norms in fp32 (their input cast up, their output
# back down), as FSDP runs them under a low-precision policy (each is an fp32 unit of its own,
# runtime.wrap): at two threads on a 2-core EPYC VM, ResNet's fp32 batch norms and the casts
# around them took 63 ms per forward + backward at micro-batch 16 against autocast's 49
FP32_NORMS = "+fp32-norms"
# timed rounds over every (precision, micro-batch): REPEATS, more while they have taken under
# WARMUP_S (at most MAX_REPEATS), after warm-up rounds (at least one, more while they have taken
# under WARMUP_S, at most WARMUP_ROUNDS); each part's median time counts
REPEATS = 3
MAX_REPEATS = 10
WARMUP_ROUNDS = 50
WARMUP_S = 0.3
# the model's parameters, gradients and optimizer state built for real, at most
MAX_STATE_BYTES = 2 * 1024**3
# seconds the probe's steps after warm-up at micro-batch 1 may take (the sizes it scouts and its
# timed rounds at micro-batch 1 and the chosen size); a workload whose micro-batch-1 steps the
# analytic model predicts to take longer is not probed. 4 s reaches micro-batch 16 for the mlp
# and ResNet and 8 for gpt tiny on one or two threads of the 2-core EPYC VM: a line through
# micro-batches 1 and 8 read ResNet's step at 16 0.84x of measured, through 1 and 4 0.72x (one
# thread, fp32, host load 4: its activations outgrow the caches), where gpt's held within 10%
BUDGET_S = 4.0
# the sizes the second timing may take, tried in this order while they fit BUDGET_S; up to the
# CPU plan's largest micro-batch (candidates.DEFAULT_MAX_MICRO_BATCH["cpu"])
MICRO_BATCHES = (2, 4, 8, 16)


@dataclass(frozen=True, kw_only=True)
class PassTimes:
    """One training step at `micro_batch`, timed by part (seconds)."""

    micro_batch: int
    data_s: float
    forward_s: float
    backward_s: float

    def __post_init__(self) -> None:
        check(self.micro_batch >= 1 and min(self.data_s, self.forward_s, self.backward_s) >= 0,
              PlanError, f"step timing at micro-batch {self.micro_batch}: negative time")


@dataclass(frozen=True, kw_only=True)
class StepTiming:
    """The measured steps of one precision: at one or two micro-batch sizes, and the optimizer."""

    precision: str
    passes: tuple[PassTimes, ...]
    optimizer_s: float

    def __post_init__(self) -> None:
        check(1 <= len(self.passes) <= 2 and self.optimizer_s >= 0, PlanError,
              "step timing needs one or two micro-batch sizes and an optimizer time >= 0")

    def at(self, micro_batch: int) -> PassTimes:
        """Data, forward and backward at `micro_batch`: a fixed cost plus a cost per sample
        through the two measured sizes (proportional to the size with only one, and past the
        larger size for a part it timed faster: noise over a tiny cost per sample, which the
        falling line would take to zero; the mlp's forward is 0.8 ms fixed, ~30 us a sample)."""
        lo, hi = self.passes[0], self.passes[-1]
        if lo.micro_batch == hi.micro_batch:
            k = micro_batch / lo.micro_batch
            return PassTimes(micro_batch=micro_batch, data_s=lo.data_s * k,
                             forward_s=lo.forward_s * k, backward_s=lo.backward_s * k)
        w = (micro_batch - lo.micro_batch) / (hi.micro_batch - lo.micro_batch)

        def line(a: float, b: float) -> float:
            if b < a and micro_batch > hi.micro_batch:
                return b * micro_batch / hi.micro_batch
            return max(0.0, a + w * (b - a))

        return PassTimes(micro_batch=micro_batch, data_s=line(lo.data_s, hi.data_s),
                         forward_s=line(lo.forward_s, hi.forward_s),
                         backward_s=line(lo.backward_s, hi.backward_s))


@dataclass(frozen=True, kw_only=True)
class WorkloadTiming:
    """Every precision's measured steps at `threads` threads, and how they were taken."""

    threads: int
    units_per_sample: int  # the sequence length (or 1) the steps ran at
    precisions: Mapping[str, StepTiming]
    load_average: float  # the host's 1-minute load when measured: a busy host reads slow
    measured_at: str = ""
    source: str = ""

    def __post_init__(self) -> None:
        check(self.threads >= 1 and bool(self.precisions), PlanError,
              "a workload timing needs >= 1 thread and a precision")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WorkloadTiming:
        """Back from `dataclasses.asdict` (the cache's JSON)."""
        precisions = {
            name: StepTiming(precision=t["precision"], optimizer_s=t["optimizer_s"],
                             passes=tuple(PassTimes(**p) for p in t["passes"]))
            for name, t in data["precisions"].items()}
        return cls(**{**data, "precisions": precisions})

    def describe(self) -> str:
        """'measured here: fp32 0.31 s, bf16 0.2 s per step at micro-batch 8, 1 thread (...)'."""
        parts = [f"{name} {p.data_s + p.forward_s + p.backward_s + t.optimizer_s:.3g} s"
                 for name, t in self.precisions.items() for p in t.passes[-1:]]
        mb = next(iter(self.precisions.values())).passes[-1].micro_batch
        busy = f", host load {self.load_average:.1f}" if self.load_average >= 1 else ""
        return (f"compute from steps of this workload timed on this host ({', '.join(parts)} per "
                f"step at micro-batch {mb}, {self.threads} thread{'s' if self.threads > 1 else ''}"
                f", {self.measured_at.replace('T', ' ')}{busy})")


def probe_micro_batches(step_s: Mapping[int, float], precisions: int) -> tuple[int, ...]:
    """The micro-batch sizes the probe may time, from the analytic model's step time per size
    (keys 1 and those of MICRO_BATCHES that fit in memory): 1 and every such size (the probe
    picks among them by its own measured steps, `scout_size`), or () when the model predicts
    that even micro-batch 1's steps take longer than BUDGET_S."""
    if 1 not in step_s or step_s[1] * (1 + REPEATS) * precisions > BUDGET_S:
        return ()
    return (1, *(mb for mb in MICRO_BATCHES if mb in step_s))


def scout_size(round_s: Callable[[int], float], anchor_s: float, anchor: int,
               sizes: Sequence[int], budget_s: float = BUDGET_S) -> tuple[int, float]:
    """The largest of `sizes` (ascending) whose timed rounds fit `budget_s`: each size is tried
    (`round_s(mb)`: seconds of one step per precision at mb, which also warms that size) only
    while the seconds spent trying, its guessed round and REPEATS rounds of it and of the anchor
    (`anchor_s` at `anchor`) fit; the guess is a fixed cost plus a cost per sample through the
    anchor and the last size tried (from the anchor alone: proportional, an upper bound).
    Returns the size and its round's seconds (`anchor` and `anchor_s` when none fits)."""
    spent, chosen, chosen_s = 0.0, anchor, anchor_s
    for mb in sizes:
        if chosen == anchor:
            guess = anchor_s * mb / anchor
        else:
            guess = chosen_s + (chosen_s - anchor_s) * (mb - chosen) / (chosen - anchor)
        if spent + guess + REPEATS * (anchor_s + guess) > budget_s:
            break
        took = round_s(mb)
        spent += took
        chosen, chosen_s = mb, took
    return chosen, chosen_s


def fp32_norm_switch(torch: Any, model: Any) -> list[bool]:
    """Hooks on `model`'s batch norms that, while the returned switch's one element is True, run
    them in fp32 and hand their output back in bf16 (as FSDP's fp32 units do, see FP32_NORMS)."""
    switch = [False]
    for norm in batch_norms(model):
        norm.register_forward_pre_hook(lambda _m, args: tuple(a.float() for a in args) if switch[0] else None)
        norm.register_forward_hook(lambda _m, _args, out: out.to(torch.bfloat16) if switch[0] else None)
    return switch


def _session(torch: Any, workload: Workload, max_micro_batch: int,
             precisions: Sequence[str]) -> Callable[[str, int], tuple[float, ...]]:
    """A fresh model, optimizer and dataset, and a function that trains one step on them at
    (precision, micro-batch): seconds of data fetch, forward, backward and optimizer step."""
    from torch.utils.data import default_collate

    torch.manual_seed(0)
    model = workload.build_model()
    optimizer = workload.make_optimizer(model)
    dataset = workload.make_dataset(max_micro_batch)
    stream = isinstance(dataset, torch.utils.data.IterableDataset)
    # hooks only when a timing needs them: every other timing's batch norms run without
    fp32_norms = (fp32_norm_switch(torch, model) if any(p.endswith(FP32_NORMS) for p in precisions) else [False])

    def step(precision: str, mb: int) -> tuple[float, ...]:
        t0 = time.perf_counter()
        # what DataLoader(num_workers=0) does per batch: fetch and collate the samples
        batch = default_collate(list(itertools.islice(iter(dataset), mb)) if stream
                                else [dataset[i] for i in range(mb)])
        t1 = time.perf_counter()
        fp32_norms[0] = precision.endswith(FP32_NORMS)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32"):
            loss = workload.loss_fn(model, batch)
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3

    return step


def measure_steps(workload: Workload, *, threads: int, precisions: Sequence[str],
                  micro_batches: Sequence[int], budget_s: float = BUDGET_S) -> WorkloadTiming:
    """Train `workload` for a few steps per precision on this CPU with `threads` threads at
    the first of `micro_batches` and the largest of the rest its measured steps leave time for
    within `budget_s` (`scout_size`); the median of REPEATS or more timed steps per part."""
    import torch  # deferred: the probe runs only when its cache entry is missing

    started = time.perf_counter()
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    # the planning process holds ~1M objects of torch and Dynamo: collections of them land in
    # a tiny model's timed steps (1.5-2x slower) where a rank in its steady state has none
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        anchor = micro_batches[0]
        step = _session(torch, workload, max(micro_batches), precisions)

        def round_s(mb: int) -> float:
            t = time.perf_counter()
            for p in precisions:
                step(p, mb)
            return time.perf_counter() - t

        # warm allocations, kernels, optimizer state and Python's specializing interpreter:
        # rounds at the anchor while they are cheap (half of WARMUP_S, at most WARMUP_ROUNDS; the
        # chosen sizes get the other half); one more (the first is cold: bf16's first autocast
        # step alone took 2 s) decides which larger sizes fit, each tried once (warming it)
        warm_start, rounds, half_s = time.perf_counter(), 0, WARMUP_S / 2
        while rounds < WARMUP_ROUNDS and (not rounds or time.perf_counter() - warm_start <= half_s):
            round_s(anchor)
            rounds += 1
        anchor_s = round_s(anchor)
        size, size_s = scout_size(round_s, anchor_s, anchor, sorted(set(micro_batches[1:]) - {anchor}), budget_s)
        sizes = (anchor,) if size == anchor else (anchor, size)
        configs = [(p, mb) for p in precisions for mb in sizes]
        # cheap as the MLP is (a round over every configuration within half of WARMUP_S, as
        # when the probe timed it before scouting sizes), not ResNet: its steps at 16 are not
        if rounds > 2 and anchor_s + (size_s if size != anchor else 0.0) <= half_s:
            # a cheap model: warm the chosen configurations as the anchor's were
            warm_start, more = time.perf_counter(), 0
            while more < WARMUP_ROUNDS and time.perf_counter() - warm_start <= half_s:
                for c in configs:
                    step(*c)
                more += 1
            # a tiny model: its first model and optimizer in a process stay 1.3-1.8x slower than
            # any built after them, whatever the warm-up (measured with the 0.9M-param MLP); a
            # rank trains for hundreds of steps, so time a second pair, as warm as a rank's
            step = _session(torch, workload, max(sizes), precisions)
            for c in configs:
                step(*c)
        samples: dict[tuple[str, int], list[tuple[float, ...]]] = {c: [] for c in configs}
        timed_start = time.perf_counter()
        for r in range(MAX_REPEATS):
            if r >= REPEATS and time.perf_counter() - timed_start > WARMUP_S:
                break
            for c in configs:
                samples[c].append(step(*c))
        # each part's median, as runs report median steps: the fastest of ten 4 ms steps of
        # the MLP read 10-15% below a rank's median, where the median of a plain loop matched
        best = {c: [statistics.median(t[k] for t in ts) for k in range(4)] for c, ts in samples.items()}
        timings = {}
        for p in precisions:
            passes = tuple(PassTimes(micro_batch=mb, data_s=best[p, mb][0], forward_s=best[p, mb][1],
                                     backward_s=best[p, mb][2]) for mb in sizes)
            timings[p] = StepTiming(precision=p, passes=passes,
                                    optimizer_s=statistics.median(best[p, mb][3] for mb in sizes))
    finally:
        torch.set_num_threads(saved_threads)
        if gc_was_enabled:
            gc.enable()
    elapsed = time.perf_counter() - started
    return WorkloadTiming(threads=threads, units_per_sample=workload.units_per_sample,
                          precisions=timings, load_average=round(os.getloadavg()[0], 2),
                          measured_at=datetime.datetime.now().isoformat(timespec="seconds"),
                          source=f"step probe: {len(precisions)} precision(s) x micro-batch "
                                 f"{'/'.join(map(str, sizes))} (of up to {max(micro_batches)} within {budget_s:g} s), "
                                 f"{REPEATS} timed steps each, torch {torch.__version__} ({elapsed:.2f} s)")


def probe_precisions(base: Sequence[str], norm_count: int) -> tuple[str, ...]:
    """The timings the probe takes: each of `base`, and for a model with batch norms each low
    precision again with them in fp32 (what `timing_key` reads for FSDP)."""
    return (*base, *(p + FP32_NORMS for p in base if p != "fp32" and norm_count > 0))


def timing_key(precision: str, strategy_kind: str, norm_count: int) -> str:
    """The timing that measures `precision` as `strategy_kind` runs it: FSDP keeps a model's
    batch norms in fp32 under a low-precision policy (see FP32_NORMS)."""
    if precision != "fp32" and strategy_kind not in DDP_KINDS and norm_count > 0:
        return precision + FP32_NORMS
    return precision


def as_cached(timing: WorkloadTiming) -> dict[str, Any]:
    """The JSON-ready form `WorkloadTiming.from_dict` reads back."""
    return dataclasses.asdict(timing)


__all__ = ["PassTimes", "StepTiming", "WorkloadTiming", "measure_steps", "probe_micro_batches",
           "as_cached", "probe_precisions", "timing_key", "fp32_norm_switch", "scout_size", "FP32_NORMS",
           "STEP_PROBE_FORMAT", "REPEATS", "MAX_REPEATS", "WARMUP_ROUNDS", "WARMUP_S", "MAX_STATE_BYTES",
           "BUDGET_S", "MICRO_BATCHES"]

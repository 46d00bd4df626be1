"""Measure this host's CPU rates once (a fraction of a second) and cache them per machine.

The CPU step-time model (`cpu_cost`) needs what one core achieves, not the ISA peak a topology file
or CPU flags suggest: GEMMs at a large and a skinny shape for fp32 and bf16 (bf16 runs far below
fp32 on CPUs without avx512_bf16/AMX), causal attention (the CPU flash kernel; its bf16 backward ran
5x its forward at 128 tokens on an EPYC VM, fp32's 2.9x) and a 3x3 convolution, forward and
backward, per dtype (bf16 convolutions reached 0.74 of the bf16 GEMM rate there, fp32 ones all of
it), streaming bandwidth by working set, alone and with every core streaming at once (what a rank
keeps of the shared cache and memory bus), and the fp32 -> bf16 cast rate; and the fixed cost of one
tiny op (Python, dispatcher, autograd) with and without building the autograd graph, and of one
backward() call. Each is the best of a few repeats with one thread, so a busy host disturbs it less.
Then how a rank's work scales with its threads on this host (`_thread_scaling`): the large GEMM, a
streaming add within the caches and the chain of tiny ops at 1, 2, 4, ... up to every usable core,
the thread counts interleaved repeat by repeat, as speedups over one thread (SMT siblings, turbo
that drops with busy cores, OpenMP's fork and join: whatever this host does). A one-rank process of
a 2-core host runs both cores: its GEMMs reached 2.0x on a 2-core EPYC VM, its in-cache add 1.6x,
its tiny ops 1.0x. `resolve.cached_cpu_rates` caches the result next to the profiles, under
`cache_key` (CPU model, usable cores, torch version: a host that differs in any is probed afresh);
`probed_topology` swaps a CPU topology's listed figures for it. A cached probe older than
REVALIDATE_AFTER_S, or taken on a CPU with other ISA flags behind the same model name, is
re-validated by re-measuring one rate (`revalidate`: the large fp32 GEMM, ~10 ms after torch's
import) and re-probed when it moved by more than REVALIDATE_TOLERANCE.

Never imports cli, backends, jobs, runtime or report; torch only inside `measure`.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from launcher.alloc_conf import installed_torch_version
from launcher.hardware.detect import cpu_info
from launcher.hardware.types import Topology
from launcher.plan.cpu_rates import CpuRates, GlooRates, HostStream, ProbedCpu

log = logging.getLogger(__name__)

# (rows, k, n): a GEMM large enough to run near the large-GEMM rate, and a skinny one whose
# rows (8: an MLP's micro-batch) show how fast the rate falls with fewer rows
LARGE_GEMM = (256, 512, 512)
SKINNY_GEMM = (8, 512, 512)
# working sets (MiB one thread streams over: its input and output) of the streaming add, from
# within a core's L2 to beyond most last-level caches; dense where caches stop holding them
STREAM_MIB = (1, 4, 8, 12, 16, 24, 32, 64)
# elements of the cast's fp32 source: 4 MiB, within most last-level caches
CAST_NUMEL = 1 << 20
LLC_SYSFS = Path("/sys/devices/system/cpu/cpu0/cache")
# (batch, heads, tokens, head dim): causal SDPA of a small transformer's attention
ATTENTION_SHAPE = (4, 4, 256, 64)
# (batch, channels, height = width): a 3x3 convolution of a small ResNet's middle stage
CONV_SHAPE = (8, 64, 16)
REPEATS = 5
# ops in the chain of 1-element adds that times per-op overhead: ~2 ms per repeat
OP_CHAIN = 200
# elements of the streaming add whose speedup with threads the probe measures: 4 MiB read and
# written (each thread's part fits its L2 from 2 threads on; the bandwidth beyond the caches
# and its sharing are the stream curve's): the scaling of memory-bound work
SCALING_STREAM_NUMEL = 1 << 19
# thread counts the scaling is measured at: 1, 2, 4, ... and every usable core, at most this many
MAX_SCALING_POINTS = 6
# batches of REPEATS rounds the scaling takes at most (a second and third only while a GEMM or
# streaming speedup reads below 1)
SCALING_BATCHES = 3
# a cached probe is re-validated when older than this (a day), or taken on other CPU flags
REVALIDATE_AFTER_S = 86400.0
# ... and re-probed when the re-measured fp32 GEMM moved by more than this from the cached one:
# an assumption, twice the best-of-5 GEMM's run-to-run spread on the idle 2-core EPYC VM (~10%)
REVALIDATE_TOLERANCE = 0.2
# elements of the add that times the node's memory bandwidth (`host_stream`): 512 MiB read and 512 written,
# past any last-level cache
HOST_STREAM_NUMEL = 1 << 27
# bump when `measure` measures differently, so old cache entries are ignored (7: thread scaling)
PROBE_FORMAT = 7


def _best_s(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm: allocation, kernel selection, page faults
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return max(best, 1e-9)


def _gemm_gflops(torch: Any, shape: tuple[int, int, int], dtype: Any) -> float:
    m, k, n = shape
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    return 2 * m * k * n / _best_s(lambda: torch.mm(a, b), REPEATS) / 1e9


def _stream_gb_s(torch: Any, numel: int, repeats: int) -> float:
    x = torch.ones(numel)
    out = torch.empty_like(x)  # read x, write out: 8 bytes per element
    return 8 * numel / _best_s(lambda: torch.add(x, 1.0, out=out), repeats) / 1e9


def _stream_curve(torch: Any, cores: int) -> tuple[tuple[float, float, float], ...]:
    """(working set bytes, GB/s of one thread alone, GB/s of each of `cores` threads streaming
    as much at once) at each of STREAM_MIB: the cache a thread keeps, alone and beside others."""
    curve = []
    for mib in STREAM_MIB:
        numel, repeats = mib * 2**20 // 8, REPEATS if mib <= 32 else 2
        torch.set_num_threads(1)
        alone = _stream_gb_s(torch, numel, repeats)
        # one add over cores x the elements splits into one contiguous part per thread
        torch.set_num_threads(cores)
        together = _stream_gb_s(torch, numel * cores, repeats) / cores
        curve.append((float(mib * 2**20), round(alone, 2), round(together, 2)))
    torch.set_num_threads(1)
    return tuple(curve)


def _attention(torch: Any, dtype: Any) -> tuple[float, float]:
    """(forward GFLOP/s, backward / forward time), rounded, of causal SDPA at ATTENTION_SHAPE,
    FLOPs counted as the profile counts them (4 s^2 d per head group, the mask ignored)."""
    b, h, s, d = ATTENTION_SHAPE
    q, k, v = (torch.randn(b, h, s, d, dtype=dtype, requires_grad=True) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    grad = torch.randn(b, h, s, d, dtype=dtype)
    fwd = _best_s(lambda: sdpa(q, k, v, is_causal=True), 3)
    both = _best_s(lambda: sdpa(q, k, v, is_causal=True).backward(grad), 3)
    return round(4 * b * h * s * s * d / fwd / 1e9, 2), round(max(both - fwd, 0.1 * fwd) / fwd, 3)


def _conv(torch: Any, dtype: Any) -> tuple[float, float]:
    """(forward GFLOP/s, backward / forward time), rounded, of a 3x3 convolution at CONV_SHAPE."""
    b, c, hw = CONV_SHAPE
    x = torch.randn(b, c, hw, hw, dtype=dtype, requires_grad=True)
    w = torch.randn(c, c, 3, 3, dtype=dtype, requires_grad=True)
    conv = torch.nn.functional.conv2d
    grad = torch.randn(b, c, hw, hw, dtype=dtype)
    fwd = _best_s(lambda: conv(x, w, padding=1), 3)
    both = _best_s(lambda: conv(x, w, padding=1).backward(grad), 3)
    return round(2 * b * c * c * 9 * hw * hw / fwd / 1e9, 2), round(max(both - fwd, 0.1 * fwd) / fwd, 3)


def _add_chain(torch: Any, x: Any, n: int = OP_CHAIN) -> Any:
    """`n` 1-element adds in a row: what the per-op overhead is timed by."""
    for _ in range(n):
        x = torch.add(x, 1.0)
    return x


def _op_overheads(torch: Any) -> tuple[float, float, float]:
    """Seconds of one 1-element add without and with autograd graph building, and of one
    backward() call beyond its nodes (the engine's start-up): a chain of OP_CHAIN adds, and a
    backward through one add."""
    plain, leaf = torch.ones(1), torch.ones(1, requires_grad=True)
    op_s = _best_s(lambda: _add_chain(torch, plain), REPEATS) / OP_CHAIN
    graph_op_s = _best_s(lambda: _add_chain(torch, leaf), REPEATS) / OP_CHAIN
    backward_s = _best_s(lambda: _add_chain(torch, leaf, 1).backward(), 4 * REPEATS) - graph_op_s
    return round(op_s, 9), round(graph_op_s, 9), round(max(backward_s, op_s), 9)


def scaling_threads(cores: int) -> tuple[int, ...]:
    """1, 2, 4, ... below `cores`, and `cores`: at most MAX_SCALING_POINTS of them (1, 2 and the
    largest: a rank's threads are cores // ranks)."""
    counts = sorted({*(2**i for i in range(max(1, cores).bit_length()) if 2**i < cores), max(1, cores)})
    if len(counts) <= MAX_SCALING_POINTS:
        return tuple(counts)
    return (*counts[:2], *counts[-(MAX_SCALING_POINTS - 2):])


def _thread_scaling(torch: Any, cores: int) -> dict[str, tuple[tuple[float, float], ...]]:
    """Speedup over one thread of a large GEMM, an in-cache streaming add and a chain of tiny
    ops at each of `scaling_threads(cores)`: the best of REPEATS (or up to SCALING_BATCHES x
    REPEATS) per thread count, the counts taken in turn within each repeat so that drift in the
    host's speed hits all of them alike."""
    a, b = torch.randn(*LARGE_GEMM[:2]), torch.randn(*LARGE_GEMM[1:])
    x = torch.ones(SCALING_STREAM_NUMEL)
    out, one = torch.empty_like(x), torch.ones(1)
    work = {"gemm": lambda: torch.mm(a, b), "stream": lambda: torch.add(x, 1.0, out=out),
            "op": lambda: _add_chain(torch, one)}
    counts = scaling_threads(cores)
    best = {(kind, n): float("inf") for kind in work for n in counts}
    for n in counts:  # warm each thread count's OpenMP team and kernels
        torch.set_num_threads(n)
        for fn in work.values():
            fn()
    for batch in range(SCALING_BATCHES):
        # more repeats only while a speedup reads below 1: another process held a core the
        # extra threads wanted for a moment (an OpenMP team then waits on it: 10x slower)
        if batch and min(best[k, 1] / best[k, n] for k in ("gemm", "stream") for n in counts) >= 1:
            break
        for _ in range(REPEATS):
            for n in counts:
                torch.set_num_threads(n)
                for kind, fn in work.items():
                    t = time.perf_counter()
                    fn()
                    best[kind, n] = min(best[kind, n], time.perf_counter() - t)
    torch.set_num_threads(1)
    return {kind: tuple((float(n), round(best[kind, 1] / max(best[kind, n], 1e-9), 3))
                        for n in counts) for kind in work}


def flags_digest(flags: frozenset[str]) -> str:
    """A short digest of the CPU's ISA flags: a generic model name ("AMD EPYC") names no core."""
    return hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:12]


def llc_bytes(root: Path = LLC_SYSFS) -> float:
    """The largest cache sysfs lists for cpu0 (the last level), in bytes; 0 when unknown."""
    best = 0.0
    for size in root.glob("index*/size"):
        try:
            text = size.read_text(encoding="utf-8").strip().upper()
        except OSError:
            continue
        scale = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * scale)
    return best


def half_rows(large_gflops: float, skinny_gflops: float, rows: int) -> float:
    """The rows at which rate(r) = large x r / (r + half) halves, from the skinny GEMM's rate."""
    return max(0.0, rows * (large_gflops / skinny_gflops - 1))


def host_stream() -> HostStream:
    """The node's memory bandwidth: an out-of-place add over HOST_STREAM_NUMEL fp32 elements with a
    thread on every usable core (whatever OMP_NUM_THREADS says: the cache key is the cores), read and
    write counted, best of REPEATS (~0.5 s with the allocation)."""
    import torch  # deferred: measured only when its cache entry is missing

    threads = torch.get_num_threads()
    torch.set_num_threads(cpu_info().usable_cores)
    try:
        gb_s = _stream_gb_s(torch, HOST_STREAM_NUMEL, REPEATS)
    finally:
        torch.set_num_threads(threads)
    return HostStream(gb_s=round(gb_s, 1), measured_at=datetime.datetime.now().isoformat(timespec="seconds"))


def measure() -> CpuRates:
    """Time GEMMs, attention, a convolution, a streaming add, a cast and tiny ops on one
    thread of this host, and the streaming add on all its cores (about a second)."""
    import torch  # deferred: the probe runs only when its cache entry is missing

    started = time.perf_counter()
    info = cpu_info()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gemm, half, attn, attn_bwd, conv, conv_bwd = {}, {}, {}, {}, {}, {}
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            large, skinny = (_gemm_gflops(torch, shape, dtype) for shape in (LARGE_GEMM, SKINNY_GEMM))
            gemm[name], half[name] = round(large, 2), round(half_rows(large, skinny, SKINNY_GEMM[0]), 3)
            attn[name], attn_bwd[name] = _attention(torch, dtype)
            conv[name], conv_bwd[name] = _conv(torch, dtype)
        # the ranks of a node share the last-level cache and the memory bus: the curve is what
        # one thread keeps of them alone and with every core streaming beside it
        curve = _stream_curve(torch, info.usable_cores)
        src, half_x = torch.ones(CAST_NUMEL), torch.empty(CAST_NUMEL, dtype=torch.bfloat16)
        cast = 6 * CAST_NUMEL / _best_s(lambda: half_x.copy_(src), REPEATS) / 1e9
        op_s, graph_op_s, backward_s = _op_overheads(torch)
        scaling = _thread_scaling(torch, info.usable_cores)
    finally:
        torch.set_num_threads(threads)
    elapsed = time.perf_counter() - started
    return CpuRates(gemm_gflops=gemm, half_rows=half, mem_gb_s=curve[-1][1],
                    cache_gb_s=max(p[1] for p in curve), cast_gb_s=round(cast, 2),
                    stream_curve=curve, llc_bytes=llc_bytes(), op_s=op_s, graph_op_s=graph_op_s,
                    backward_call_s=backward_s, attention_gflops=attn, attention_bwd_factor=attn_bwd,
                    conv_gflops=conv, conv_bwd_factor=conv_bwd, thread_speedup=scaling,
                    cpu_model=info.model, cpu_flags=flags_digest(info.flags), cores=info.usable_cores,
                    measured_at=datetime.datetime.now().isoformat(timespec="seconds"),
                    source=f"CPU probe, torch {torch.__version__}, one thread (and 1-{info.usable_cores} for the "
                           f"scaling), best of {REPEATS} ({elapsed:.2f} s)")


def quick_gemm_gflops() -> float:
    """The large fp32 GEMM's rate on one thread, measured as `measure` does: the one rate a
    cached probe is re-validated by."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _gemm_gflops(torch, LARGE_GEMM, torch.float32)
    finally:
        torch.set_num_threads(threads)


def needs_revalidation(rates: CpuRates, now: datetime.datetime, flags: str) -> str:
    """Why the cached `rates` must be re-validated before use ("" when not): older than
    REVALIDATE_AFTER_S since measured or last validated, or taken on other CPU flags."""
    if rates.cpu_flags and rates.cpu_flags != flags:
        return "taken on a CPU with other ISA flags"
    stamp = rates.validated_at or rates.measured_at
    try:
        age_s = (now - datetime.datetime.fromisoformat(stamp)).total_seconds()
    except ValueError:
        return "of unknown age"
    return f"{age_s / 3600:.0f} h old" if age_s > REVALIDATE_AFTER_S else ""


def revalidate(rates: CpuRates, gemm_gflops: float, now: datetime.datetime, flags: str) -> CpuRates | None:
    """`rates` stamped valid at `now` (on this CPU's `flags`) when the re-measured fp32 GEMM
    (`gemm_gflops`) is within REVALIDATE_TOLERANCE of the cached one, else None: probe again."""
    cached = rates.gemm_gflops["fp32"]
    if abs(gemm_gflops / cached - 1) > REVALIDATE_TOLERANCE:
        log.info("the cached CPU probe's fp32 GEMM (%.1f GFLOP/s) is %.1f now: probing again", cached, gemm_gflops)
        return None
    return dataclasses.replace(rates, cpu_flags=flags, validated_at=now.isoformat(timespec="seconds"))


def torch_version() -> str:
    """The installed torch's version, read without importing torch (a cached lookup must stay
    fast); "none" without torch."""
    return installed_torch_version() or "none"


def cache_key(cpu_model: str, cores: int, torch_version: str) -> str:
    """A cache entry's name: CPU model, usable cores, torch version and the probe's format."""
    return hashlib.sha256(json.dumps([cpu_model, cores, torch_version, PROBE_FORMAT]).encode()).hexdigest()[:32]


def probed_topology(topology: Topology, rates: CpuRates, gloo: GlooRates | None = None) -> Topology:
    """`topology` (a CPU one) with its device's listed FLOP/s replaced by the measurement: one
    process's share of the host's cores (the DeviceSpec contract), and the probes' rates for
    the cost model (`gloo`: the collectives between its ranks, when measured). bf16 is listed
    (torch runs it on any CPU); the rates say whether it is faster."""
    dev, ranks = topology.accelerator, topology.devices_per_node
    cores = rates.cores or topology.cpu_cores_per_node
    day = rates.measured_at.replace("T", " ")
    accel = ProbedCpu(
        name=f"{rates.cpu_model} - one of {ranks} processes (rates measured by the CPU probe {day})",
        mem_gib=dev.mem_gib,
        peak_tflops={k: round(v * cores / ranks / 1e3, 5) for k, v in rates.gemm_gflops.items()},
        source=f"{rates.source} at {rates.measured_at}; replaces: {dev.source}".strip(),
        rates=rates, gloo=gloo)
    return dataclasses.replace(topology, accelerator=accel, cpu_cores_per_node=cores)


__all__ = ["measure", "host_stream", "torch_version", "cache_key", "probed_topology", "half_rows", "llc_bytes",
           "scaling_threads", "flags_digest", "quick_gemm_gflops", "needs_revalidation",
           "revalidate", "LARGE_GEMM", "SKINNY_GEMM", "PROBE_FORMAT", "REVALIDATE_AFTER_S",
           "REVALIDATE_TOLERANCE"]

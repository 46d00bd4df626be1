"""What the CPU probes measured on this host, as frozen values: compute rates per core (`CpuRates`,
from `cpu_probe`), the cost of gloo collectives between ranks that share the host (`GlooRates`, from
`gloo_probe`), the CPU "device" that carries them (`ProbedCpu`), and each rank's share of the cores
as the probe measured it per kind of work (`CpuRates.thread_speedup`), not assumed.

Pure values: no torch, no I/O; never imports cli, backends, jobs, runtime, results or report.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from launcher.errors import PlanError
from launcher.hardware.types import DeviceSpec, Topology
from launcher.specs import check

# Used only when the probe did not measure how a rank's threads scale (a cache from before probe
# format 7, a topology file planned elsewhere): the share of a core the second and later OpenMP
# threads of one rank add. Measured: gpt tiny (micro-batch 8) takes 324 ms per step on one thread
# and 197 ms on two (2-core EPYC VM, torch 2.13): 1.64x, i.e. 0.64 of a core from the second thread.
PARALLEL_EFFICIENCY = 0.6
# the kinds of work whose thread scaling the probe measures (`CpuRates.thread_speedup`): the large
# GEMM, a streaming add whose working set fits the caches, a chain of 1-element ops
THREAD_KINDS = ("gemm", "stream", "op")
# below this a rank's second thread slowed its work down by half: the probe did not have the cores
MIN_THREAD_SPEEDUP = 0.5
# A 1-element add without and with autograd graph building, and a backward() call through one,
# as the probe measured them on a 2-core 2.8 GHz Ice Lake VM with torch 2.13 (best of several,
# loaded host): used when no probe ran.
DEFAULT_OP_S = 3.9e-6
DEFAULT_GRAPH_OP_S = 4.6e-6
DEFAULT_BACKWARD_CALL_S = 30e-6
# Used when no probe ran (a topology file planned on another machine, tests): GEMMs at the
# listed peak per core (the ISA peak of `hardware.detect.cpu_peak_tflops`, 32 FLOP/cycle, is what
# the probe reaches with one thread: 75-113 GFLOP/s against 90 on a 2.8 GHz Ice Lake), and the
# rest as the probe measured on that 2-core VM with torch 2.13 (best of several, loaded host):
# fp32 at 8 rows ~0.85 of its large-GEMM rate (half_rows 1.5), 64 MiB add 5-10 GB/s, fp32 -> bf16
# cast ~2 GB/s; 4 MiB add ~14 GB/s (the 0.92M-param MLP's AdamW step streams at that rate);
# its 48 MiB last-level cache.
DEFAULT_LLC_BYTES = 48 * 1024**2
DEFAULT_HALF_ROWS = 1.5
DEFAULT_MEM_GB_S = 8.0
DEFAULT_CACHE_GB_S = 14.0
DEFAULT_CAST_GB_S = 2.0
# Without an attention or convolution probe: attention's forward at this fraction of the large-GEMM
# rate, its backward this many times the forward, convolutions at the GEMM rate (the probe's readings
# on a 2-core EPYC VM, torch 2.13, fp32: SDPA at 256 tokens 0.75 of the GEMM rate, backward 2.9x;
# 3x3 convolutions at 1.0, backward 2.2x).
DEFAULT_ATTENTION_FRACTION = 0.75
DEFAULT_ATTENTION_BWD = 3.0
DEFAULT_CONV_BWD = 2.2


@dataclass(frozen=True, kw_only=True)
class CpuRates:
    """What the probe measured on one core of this host (one thread)."""

    gemm_gflops: Mapping[str, float]  # large-GEMM rate by dtype (fp32, bf16)
    half_rows: Mapping[str, float]  # rows of a GEMM at which it runs at half that rate
    mem_gb_s: float  # streaming bandwidth (read + write) of one thread, beyond the caches
    cache_gb_s: float  # the same on a working set that fits the last-level cache
    cast_gb_s: float  # fp32 -> bf16 conversion bandwidth (bytes read + written)
    llc_bytes: float = 0.0  # the host's last-level cache (shared by all ranks); 0 = unknown
    # a streaming add by working set: (bytes one thread streams over, GB/s of that thread alone,
    # GB/s of each thread while every usable core streams as much), ascending; empty = not
    # measured (llc_bytes, cache_gb_s and mem_gb_s stand in). What a cache keeps is less than its
    # size and falls with neighbours: on a 2-core EPYC VM (32 MiB L3) one thread streams 16 MiB
    # at 40-68 GB/s, two side by side at 17-23 each
    stream_curve: tuple[tuple[float, float, float], ...] = ()
    # fixed seconds of one 1-element op without (op_s) and with (graph_op_s) autograd graph
    # building, and of one backward() call beyond its nodes
    op_s: float = DEFAULT_OP_S
    graph_op_s: float = DEFAULT_GRAPH_OP_S
    backward_call_s: float = DEFAULT_BACKWARD_CALL_S
    # causal scaled-dot-product attention: forward FLOP rate as the profile counts its FLOPs
    # (4 s^2 d per layer, the mask ignored) and backward time over forward time, by dtype
    attention_gflops: Mapping[str, float] = field(default_factory=dict)
    attention_bwd_factor: Mapping[str, float] = field(default_factory=dict)
    # 3x3 convolutions: forward FLOP rate and backward time over forward time, by dtype
    conv_gflops: Mapping[str, float] = field(default_factory=dict)
    conv_bwd_factor: Mapping[str, float] = field(default_factory=dict)
    # how much faster one rank's work runs on n threads than on one, by kind (THREAD_KINDS): (threads,
    # speedup) ascending from (1, 1.0); empty = not measured (PARALLEL_EFFICIENCY)
    thread_speedup: Mapping[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    cpu_model: str = ""
    cpu_flags: str = ""  # digest of the CPU's ISA flags (a generic model name hides the core)
    cores: int = 1
    measured_at: str = ""  # ISO time of the measurement
    validated_at: str = ""  # ISO time a quick re-measure last agreed with it ("" = never since)
    source: str = ""

    def __post_init__(self) -> None:
        check("fp32" in self.gemm_gflops, PlanError, "CPU rates need an fp32 GEMM rate")
        for name, value in (*self.gemm_gflops.items(), *self.attention_gflops.items(),
                            *self.conv_gflops.items(), ("mem_gb_s", self.mem_gb_s),
                            ("cache_gb_s", self.cache_gb_s), ("cast_gb_s", self.cast_gb_s)):
            check(value > 0, PlanError, f"CPU rate {name} must be > 0, got {value}")
        # JSON (the probe's cache) gives lists
        object.__setattr__(self, "stream_curve", tuple(sorted(tuple(map(float, p)) for p in self.stream_curve)))
        check(all(len(p) == 3 and min(p) > 0 for p in self.stream_curve), PlanError,
              "CPU stream curve points need (bytes, GB/s alone, GB/s side by side) > 0")
        check(all(v >= 0 for v in self.half_rows.values()), PlanError, "CPU GEMM half_rows must be >= 0")
        check(all(v > 0 for v in (*self.attention_bwd_factor.values(), *self.conv_bwd_factor.values())),
              PlanError, "CPU backward factors must be > 0")
        check(min(self.op_s, self.graph_op_s, self.backward_call_s) >= 0, PlanError, "CPU op overheads must be >= 0")
        object.__setattr__(self, "thread_speedup", {kind: tuple(sorted((float(n), float(x)) for n, x in points))
                                                    for kind, points in self.thread_speedup.items()})
        check(all(kind in THREAD_KINDS and points and all(n >= 1 and x > 0 for n, x in points)
                  for kind, points in self.thread_speedup.items()), PlanError,
              f"CPU thread speedups need kinds among {THREAD_KINDS} and (threads >= 1, speedup > 0)")

    def implausible(self) -> str | None:
        """Why these rates cannot be this host's own (a probe disturbed by other work: a test suite's
        workers, a training run), or None. Idle, n threads of one rank run at least as fast as one,
        and each of the host's cores streaming at once keeps at least 1/cores of what one alone
        gets from memory (they share the bus; a working set that fits the cache alone may not fit
        it side by side); half of either floor is left for noise."""
        for kind, points in self.thread_speedup.items():
            for n, x in points:
                if n > 1 and x < MIN_THREAD_SPEEDUP:
                    return f"{kind} work ran {x:.2f}x as fast on {n:g} threads as on one"
        # beyond the last-level cache the cores share the memory bus: no less than its share of that
        dram = self.stream_curve[-1][1] if self.stream_curve else 0.0
        for size, alone, side in self.stream_curve:
            if side < min(alone, dram) / (2 * max(1, self.cores)):
                return (f"each core streaming {size / 2**20:g} MiB side by side got {side:g} GB/s against "
                        f"{alone:g} alone")
        return None

    def speedup(self, kind: str, threads: int) -> float | None:
        """How much faster `kind` work runs on `threads` threads than on one: the measured points,
        linear between them and flat beyond the last; None unmeasured."""
        points = self.thread_speedup.get(kind)
        if not points:
            return None
        if threads <= points[0][0]:
            return points[0][1]
        for (n0, x0), (n1, x1) in zip(points, points[1:]):
            if threads <= n1:
                return x0 + (threads - n0) / (n1 - n0) * (x1 - x0)
        return points[-1][1]

    def dtype(self, precision: str) -> str:
        """The rates' key for `precision`: itself when measured, else fp32."""
        return precision if precision in self.gemm_gflops else "fp32"

    def stream_gb_s(self, working_set: float, *, all_cores: bool = False) -> float:
        """GB/s of one thread streaming over `working_set` bytes, alone or (`all_cores`) while every
        usable core streams as much: the measured curve (seconds per byte linear in log(bytes), flat
        beyond its ends); unmeasured, the part that fits the last-level cache at cache_gb_s, the rest
        at mem_gb_s (all cores as one thread over all of their working sets)."""
        if not self.stream_curve:
            ws = working_set * (max(1, self.cores) if all_cores else 1)
            cached = min(1.0, self.llc_bytes / ws) if ws > 0 else 1.0
            return 1 / (cached / self.cache_gb_s + (1 - cached) / self.mem_gb_s)
        col = 2 if all_cores else 1
        points = [(p[0], 1 / p[col]) for p in self.stream_curve]
        if working_set <= points[0][0]:
            return 1 / points[0][1]
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            if working_set <= x1:
                f = math.log(working_set / x0) / math.log(x1 / x0)
                return 1 / (y0 + f * (y1 - y0))
        return 1 / points[-1][1]

    def attention(self, precision: str) -> tuple[float, float]:
        """(forward FLOP/s, backward / forward) of attention at `precision`."""
        d = self.dtype(precision)
        rate = self.attention_gflops.get(d) or DEFAULT_ATTENTION_FRACTION * self.gemm_gflops[d]
        return rate * 1e9, self.attention_bwd_factor.get(d, DEFAULT_ATTENTION_BWD)

    def conv(self, precision: str) -> tuple[float, float]:
        """(forward FLOP/s, backward / forward) of convolutions at `precision`."""
        d = self.dtype(precision)
        rate = self.conv_gflops.get(d) or self.gemm_gflops[d]
        return rate * 1e9, self.conv_bwd_factor.get(d, DEFAULT_CONV_BWD)


COLLECTIVES = ("ar", "ag", "rs")  # all-reduce, all-gather, reduce-scatter


@dataclass(frozen=True, kw_only=True)
class HostStream:
    """This node's memory bandwidth with every thread streaming (`cpu_probe.host_stream`): what CPU
    offload's optimizer step on the host runs at (`Host.mem_bw_gb_s`, `plan.offload`'s unit)."""

    gb_s: float
    measured_at: str = ""

    def __post_init__(self) -> None:
        check(self.gb_s > 0, PlanError, f"host memory bandwidth must be > 0 GB/s, got {self.gb_s}")


@dataclass(frozen=True, kw_only=True)
class GlooRates:
    """What one gloo collective costs between `ranks` processes of this host that compute between
    collectives (as in training): a latency and a time per byte, by collective. Sizes follow
    nccl-tests: all-gather counts its gathered output, reduce-scatter its input, all-reduce its buffer."""

    ranks: int
    latency_s: Mapping[str, float]
    s_per_byte: Mapping[str, float]
    cores: int = 1
    measured_at: str = ""
    source: str = ""

    def __post_init__(self) -> None:
        check(self.ranks >= 1, PlanError, f"gloo rates need >= 1 rank, got {self.ranks}")
        for op in COLLECTIVES:
            check(self.latency_s.get(op, -1) >= 0 and self.s_per_byte.get(op, -1) >= 0, PlanError,
                  f"gloo rates need a latency and a time per byte >= 0 for {op}")

    def collective_s(self, op: str, nbytes: float) -> float:
        """Seconds of one `op` ("ar", "ag", "rs") of `nbytes`."""
        return self.latency_s[op] + nbytes * self.s_per_byte[op] if nbytes > 0 else 0.0


@dataclass(frozen=True, kw_only=True)
class ProbedCpu(DeviceSpec):
    """One CPU process's share of a host (the DeviceSpec contract), with the probes' rates."""

    rates: CpuRates
    gloo: GlooRates | None = None  # None: one rank, or not measured (the link's figures apply)


def rates_of(device: DeviceSpec, topology: Topology) -> CpuRates:
    """The probe's rates, or the device's listed peak per core with the default rest."""
    if isinstance(device, ProbedCpu):
        return device.rates
    per_core = topology.devices_per_node / max(1, topology.cpu_cores_per_node)
    return CpuRates(gemm_gflops={k: v * 1e3 * per_core for k, v in device.peak_tflops.items()},
                    half_rows={k: DEFAULT_HALF_ROWS for k in device.peak_tflops}, mem_gb_s=DEFAULT_MEM_GB_S,
                    cache_gb_s=DEFAULT_CACHE_GB_S, cast_gb_s=DEFAULT_CAST_GB_S, llc_bytes=DEFAULT_LLC_BYTES,
                    source=f"listed peak of {device.name} (no probe)")


def gloo_of(topology: Topology) -> GlooRates | None:
    """The measured gloo rates for this topology's ranks, if the probe ran for them."""
    device = topology.accelerator
    if isinstance(device, ProbedCpu) and device.gloo is not None and topology.num_nodes == 1 \
            and device.gloo.ranks == topology.devices_per_node:
        return device.gloo
    return None


def _measured(topology: Topology, kind: str) -> float | None:
    device = topology.accelerator
    return device.rates.speedup(kind, topology.rank_threads) if isinstance(device, ProbedCpu) else None


def core_share(topology: Topology, kind: str = "gemm") -> float:
    """Cores' worth of `kind` work (THREAD_KINDS) one rank gets: the speedup the probe measured on
    this host at the rank's threads, or without a measurement its first thread whole and each
    further one at PARALLEL_EFFICIENCY; cores/ranks when ranks outnumber the cores."""
    cores, ranks = max(1, topology.cpu_cores_per_node), topology.devices_per_node
    if ranks > cores:
        return cores / ranks
    measured = _measured(topology, kind)
    # below 1 only when other processes held the cores the extra threads wanted (a busy host:
    # such a probe serves one plan and is not cached, host_quiet); the run gets the cores
    if measured is not None and measured >= 1:
        return measured
    return 1 + (topology.rank_threads - 1) * PARALLEL_EFFICIENCY


def time_share(topology: Topology) -> float:
    """How much longer one thread's work takes on a rank: ranks / cores when the ranks outnumber
    the cores (they time-share them), else 1 (extra threads do not speed up serial work)."""
    cores, ranks = max(1, topology.cpu_cores_per_node), topology.devices_per_node
    return ranks / cores if ranks > cores else 1.0


def op_share(topology: Topology) -> float:
    """How much slower (< 1) a rank's per-op overhead runs than one thread's alone: the probe's "op"
    speedup at the rank's threads, at most 1 (a tiny op runs on the calling thread: more threads cannot
    speed it up, an OpenMP team may slow it; 1 unmeasured), or cores/ranks when ranks outnumber cores."""
    cores, ranks = max(1, topology.cpu_cores_per_node), topology.devices_per_node
    if ranks > cores:
        return cores / ranks
    measured = _measured(topology, "op")
    return 1.0 if measured is None else min(1.0, measured)


__all__ = ["CpuRates", "GlooRates", "ProbedCpu", "COLLECTIVES", "rates_of", "gloo_of", "core_share", "time_share",
           "op_share", "PARALLEL_EFFICIENCY", "THREAD_KINDS", "DEFAULT_OP_S", "DEFAULT_GRAPH_OP_S",
           "DEFAULT_BACKWARD_CALL_S", "DEFAULT_LLC_BYTES", "DEFAULT_HALF_ROWS", "DEFAULT_MEM_GB_S",
           "DEFAULT_CACHE_GB_S", "DEFAULT_CAST_GB_S", "DEFAULT_ATTENTION_FRACTION", "DEFAULT_ATTENTION_BWD",
           "DEFAULT_CONV_BWD"]

"""What `dlaunch doctor`'s checks should measure on healthy hardware, each figure with its source.

Per rank: a large GEMM's FLOP/s in the doctor's precision and a large copy's bytes/s (read +
written); per node and across nodes: the all-reduce bus bandwidth of their ranks. The figures come
from the topology the doctor is judged against, as the planner reads its peaks:

  GPU   GEMM: the device's dense peak for the precision (topology file, or the datasheet figure
        detection fills in) x the large-GEMM fraction a GPU achieves (cost.GEMM_PEAK_FRACTION:
        ~0.8 of the datasheet); copy: the HBM bandwidth (hbm.hbm_bytes_per_s, datasheets) x
        COPY_PEAK_FRACTION; all-reduce: the topology's links, which are achievable busbw already.
  CPU   with this host's probes (`cpu_rates.ProbedCpu`, what plan.resolve attaches): the CPU
        probe's one-thread GEMM rate x each rank's cores' worth as the planner counts it
        (`cpu_rates.core_share`), its streaming rate at the copy's working set with every rank
        streaming at once, and the gloo probe's all-reduce cost; measurements, so taken whole
        (fraction 1). From a topology file without a probe (SLURM nodes): the listed peak shared
        between the node's ranks, its link; no memory figure.

Pure: no torch, no I/O; never imports cli, backends, jobs, runtime, results or report.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from launcher.hardware.types import Link, Topology
from launcher.plan.cpu_rates import PARALLEL_EFFICIENCY, ProbedCpu, gloo_of
from launcher.plan.gemm import GEMM_PEAK_FRACTION, GEMM_PEAK_FRACTION_DEFAULT
from launcher.plan.hbm import hbm_bytes_per_s

# A device-to-device copy reaches ~90% of the datasheet HBM bandwidth on A100 and H100 (read +
# written bytes; STREAM-like copy kernels, e.g. nvbandwidth / babelstream reports): the share a
# healthy GPU is expected to keep.
COPY_PEAK_FRACTION = 0.9
CHECKS = ("gemm", "copy", "allreduce_node", "allreduce_world")


@dataclass(frozen=True, kw_only=True)
class Expected:
    """What one check should measure (`value`: FLOP/s or bytes/s), the figure it derives from (`peak`),
    the achievable share of it assumed (`fraction`, 1 for a measurement), and that figure's source."""

    value: float
    peak: float
    fraction: float
    source: str


@dataclass(frozen=True, kw_only=True)
class Expectations:
    """Every check's expectation (None: nothing to expect it from, the reason in `missing`), and their basis."""

    basis: str
    checks: Mapping[str, Expected | None]
    missing: Mapping[str, str] = field(default_factory=dict)


def _link_busbw(link: Link, what: str) -> Expected:
    # a topology's link figure is the achievable ring busbw already (hardware.types.Link)
    source = f"{what}: the {link.kind} link's achievable all-reduce busbw, {link.bw_gb_s:g} GB/s"
    return Expected(value=link.bw_gb_s * 1e9, peak=link.bw_gb_s * 1e9, fraction=1.0, source=source)


def _share_text(share: float, threads: int, cores: int, ranks: int, measured: bool) -> str:
    if ranks > cores:
        return f"{share:.2g} of a core per rank ({ranks} ranks on {cores} cores)"
    if threads <= 1:
        return "1 thread per rank"
    if measured:
        return f"{share:.3g} cores' worth per rank ({threads} threads: the probe's measured GEMM speedup)"
    return (f"{share:.3g} cores' worth per rank ({threads} threads, each beyond the first at "
            f"{PARALLEL_EFFICIENCY:g} as the planner counts them without a measurement)")


def _world_link(topology: Topology) -> Link | None:
    """The link a ring over every rank of several nodes is bound by: the slower of the two."""
    inter, intra = topology.inter_node, topology.intra_node
    return None if inter is None else inter if inter.bw_gb_s <= intra.bw_gb_s else intra


def gpu_expectations(topology: Topology, *, precision: str, nodes: int, basis: str) -> Expectations:
    """A GPU's checks from its topology's device and links."""
    dev = topology.accelerator
    checks: dict[str, Expected | None] = {}
    missing: dict[str, str] = {}
    tflops = dev.peak_tflops.get(precision)
    if tflops is None:
        checks["gemm"] = None
        missing["gemm"] = f"{dev.name} lists no {precision} peak"
    else:
        frac = GEMM_PEAK_FRACTION.get(dev.compute_capability or (0, 0), GEMM_PEAK_FRACTION_DEFAULT)
        checks["gemm"] = Expected(
            value=tflops * 1e12 * frac, peak=tflops * 1e12, fraction=frac,
            source=f"{dev.name}: dense {precision} peak {tflops:g} TFLOP/s x {frac:.2f}, the share "
                   "of it a large GEMM reaches (plan.cost.GEMM_PEAK_FRACTION)")
    hbm = hbm_bytes_per_s(dev)
    checks["copy"] = Expected(
        value=hbm * COPY_PEAK_FRACTION, peak=hbm, fraction=COPY_PEAK_FRACTION,
        source=f"{dev.name}: HBM {hbm / 1e9:g} GB/s (datasheet, plan.hbm.hbm_bytes_per_s) x "
               f"{COPY_PEAK_FRACTION:g}, the share a device-to-device copy reaches")
    checks["allreduce_node"] = _link_busbw(topology.intra_node, "within a node")
    _add_world(checks, missing, topology, nodes)
    return Expectations(basis=basis, checks=checks, missing=missing)


def cpu_expectations(topology: Topology, *, precision: str, ranks_per_node: int, nodes: int, threads: int,
                     copy_bytes: float, allreduce_bytes: float, basis: str) -> Expectations:
    """CPU ranks' checks: from this host's probes when `topology` carries them (ProbedCpu), else from
    the topology's listed peak (shared between `ranks_per_node` ranks) and links."""
    dev = topology.accelerator
    cores, ranks = max(1, topology.cpu_cores_per_node), max(1, ranks_per_node)
    # cores' worth of compute one rank has, as cpu_rates.core_share counts it (for these threads)
    speedup = dev.rates.speedup("gemm", max(1, threads)) if isinstance(dev, ProbedCpu) else None
    measured = ranks <= cores and speedup is not None and speedup >= 1
    share = (cores / ranks if ranks > cores else speedup if measured and speedup is not None
             else 1 + (max(1, threads) - 1) * PARALLEL_EFFICIENCY)
    checks: dict[str, Expected | None] = {}
    missing: dict[str, str] = {}
    if isinstance(dev, ProbedCpu):
        rates = dev.rates
        dtype = rates.dtype(precision)
        per_thread = rates.gemm_gflops[dtype] * 1e9
        when = rates.measured_at.replace("T", " ")
        checks["gemm"] = Expected(
            value=per_thread * share, peak=per_thread * share, fraction=1.0,
            source=f"the CPU probe of this host ({when}): {dtype} GEMM {per_thread / 1e9:.1f} "
                   f"GFLOP/s on one thread x {_share_text(share, threads, cores, ranks, measured)}")
        # the threads streaming at once (every rank copies at the same time) and their working set
        busy, working_set = min(cores, ranks * threads), copy_bytes / max(1, threads)
        all_cores = busy >= cores and cores > 1
        per_stream = rates.stream_gb_s(working_set, all_cores=all_cores) * 1e9
        checks["copy"] = Expected(
            value=per_stream * busy / ranks, peak=per_stream * busy / ranks, fraction=1.0,
            source=f"the CPU probe of this host ({when}): {per_stream / 1e9:.1f} GB/s per thread "
                   f"streaming {working_set / 2**20:.0f} MiB"
                   + (" with every core streaming" if all_cores else " alone")
                   + f", x {busy / ranks:g} thread(s) per rank")
    else:
        tflops = dev.peak_tflops.get(precision)
        if tflops is None:
            checks["gemm"] = None
            missing["gemm"] = f"{dev.name} lists no {precision} peak"
        else:
            # a CPU device is one process's share of the host, of the file's process count
            host = tflops * 1e12 * topology.devices_per_node
            checks["gemm"] = Expected(
                value=host / ranks, peak=host / ranks, fraction=1.0,
                source=f"{dev.name}: {precision} {tflops:g} TFLOP/s per process x "
                       f"{topology.devices_per_node} processes, shared by {ranks} rank(s)")
        checks["copy"] = None
        missing["copy"] = "a topology file lists no memory bandwidth (the CPU probe of the nodes would)"
    checks["allreduce_node"] = None
    if ranks > 1:
        gloo = gloo_of(topology)
        if gloo is not None and nodes == 1:
            seconds = gloo.collective_s("ar", allreduce_bytes)
            bw = allreduce_bytes / seconds * 2 * (ranks - 1) / ranks if seconds > 0 else 0.0
            checks["allreduce_node"] = Expected(
                value=bw, peak=bw, fraction=1.0,
                source=f"the gloo probe of this host ({gloo.measured_at.replace('T', ' ')}): "
                       f"{ranks} busy ranks, all-reduce of {allreduce_bytes / 2**20:.0f} MiB")
            if bw <= 0:
                checks["allreduce_node"] = None
                missing["allreduce_node"] = "the gloo probe measured no time per byte"
        else:
            checks["allreduce_node"] = _link_busbw(topology.intra_node, "within a node")
    _add_world(checks, missing, topology, nodes)
    return Expectations(basis=basis, checks=checks, missing=missing)


def _add_world(checks: dict[str, Expected | None], missing: dict[str, str], topology: Topology, nodes: int) -> None:
    """The across-nodes all-reduce's expectation (only with more than one node), or why not."""
    world = _world_link(topology) if nodes > 1 else None
    checks["allreduce_world"] = None if world is None else _link_busbw(world, "across nodes")
    if nodes > 1 and world is None:
        missing["allreduce_world"] = "the topology describes no link between nodes"


def no_expectations(basis: str) -> Expectations:
    """Nothing to expect from (a SLURM doctor without --topology): ranks judged by the median."""
    return Expectations(basis=basis, checks={c: None for c in CHECKS},
                        missing={c: "no topology of the nodes" for c in CHECKS})


__all__ = ["Expected", "Expectations", "gpu_expectations", "cpu_expectations", "no_expectations",
           "COPY_PEAK_FRACTION", "CHECKS"]

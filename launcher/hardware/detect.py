"""Detect this machine's hardware as a `Topology`: GPUs and their links, NICs, cores, SLURM.

GPUs come from `launcher.hardware.gpu_probe` (NVML, else `nvidia-smi`, else torch in a child
process); torch is never imported in this process, so `dlaunch inspect` stays fast. This module
only probes (NVML, subprocess, sysfs, psutil, the SLURM environment); turning what it finds into
links and GPU specs is `launcher.hardware.nvtopo`'s job, printing the result `launcher.hardware.view`'s.
"""

from __future__ import annotations

import logging
import math
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from launcher.hardware.gpu_probe import probe_gpus
from launcher.hardware.nvtopo import gpu_spec, inter_node_link, intra_node_link, nvlink_gb_s
from launcher.hardware.types import DeviceSpec, Host, Link, Nic, Topology
from launcher.specs import GIB

log = logging.getLogger(__name__)

_VIRTUAL_IFACES = ("lo", "docker", "veth", "br-", "virbr", "cni", "flannel", "cali", "tun",
                   "tap", "ib", "vxlan", "weave", "kube")


# -- SLURM -----------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class SlurmAllocation:
    """The SLURM job this process runs in, as its environment describes it."""

    job_id: str
    num_nodes: int
    gpus_per_node: int | None = None
    cpus_per_node: int | None = None
    nodelist: str = ""
    partition: str = ""


def _env_int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        # SLURM writes "8(x2)" for per-node values repeated across nodes
        if match := re.match(r"(\d+)", env.get(name, "").strip()):
            return int(match.group(1))
    return None


def _gres_count(spec: str) -> int | None:
    # "4", "a100:4", "gpu:a100:4", "gres/gpu:4", "a100:2,v100:1" -> summed counts
    counts = [int(m.group(1)) for item in spec.split(",") if (m := re.search(r"(\d+)(\(x\d+\))?\s*$", item.strip()))]
    return sum(counts) if counts else None


def slurm_allocation(env: Mapping[str, str] | None = None) -> SlurmAllocation | None:
    """The SLURM allocation from `env` (default `os.environ`), or None outside a SLURM job."""
    env = os.environ if env is None else env
    job_id = env.get("SLURM_JOB_ID", "").strip()
    if not job_id:
        return None
    gpus = _env_int(env, "SLURM_GPUS_ON_NODE")
    if gpus is None and env.get("SLURM_GPUS_PER_NODE"):
        gpus = _gres_count(env["SLURM_GPUS_PER_NODE"])
    if gpus is None and env.get("SLURM_JOB_GPUS"):
        gpus = len([g for g in env["SLURM_JOB_GPUS"].split(",") if g.strip()])
    return SlurmAllocation(job_id=job_id, num_nodes=max(1, _env_int(env, "SLURM_JOB_NUM_NODES", "SLURM_NNODES") or 1),
                           gpus_per_node=gpus, cpus_per_node=_env_int(env, "SLURM_CPUS_ON_NODE"),
                           nodelist=env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", "")),
                           partition=env.get("SLURM_JOB_PARTITION", ""))


# -- CPU ---------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class CpuInfo:
    """What /proc/cpuinfo and the scheduler say about this host's CPUs."""

    model: str
    flags: frozenset[str]
    sockets: int
    usable_cores: int
    ghz: float


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None


def _cores_of(cpus: set[int]) -> int | None:
    """Distinct physical cores (package, core id) among logical `cpus`; None without sysfs."""
    cores = set()
    for cpu in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        package, core = _read(topo / "physical_package_id"), _read(topo / "core_id")
        if package is None or core is None:
            return None
        cores.add((package, core))
    return len(cores) or None


def usable_cores() -> int:
    """Physical cores this process may use: affinity, cgroup CPU quota, SMT siblings removed."""
    try:
        allowed = set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        allowed = set(range(os.cpu_count() or 1))
    # two hyper-threads share one core's FMA units: count cores, not threads
    cores = _cores_of(allowed)
    if cores is None:  # no sysfs topology: assume the allowed threads spread evenly over cores
        logical, physical = psutil.cpu_count(logical=True), psutil.cpu_count(logical=False)
        cores = len(allowed)
        if logical and physical and logical > physical:
            cores = max(1, len(allowed) * physical // logical)
    quota = (_read(Path("/sys/fs/cgroup/cpu.max")) or "").split()
    if len(quota) == 2 and quota[0] != "max":
        cores = min(cores, max(1, math.ceil(int(quota[0]) / int(quota[1]))))
    return max(1, cores)


def cpu_info(cpuinfo_text: str | None = None) -> CpuInfo:
    """Model, flags, sockets, usable cores and clock (GHz) of this host."""
    text = cpuinfo_text if cpuinfo_text is not None else _read(Path("/proc/cpuinfo")) or ""
    fields: dict[str, str] = {}
    sockets: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "physical id":
            sockets.add(value)
        fields.setdefault(key, value)
    ghz = 0.0
    max_khz = _read(Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq"))
    if max_khz and max_khz.isdigit():
        ghz = int(max_khz) / 1e6
    elif fields.get("cpu MHz"):
        ghz = float(fields["cpu MHz"]) / 1000
    return CpuInfo(model=fields.get("model name", "unknown CPU"),
                   flags=frozenset(fields.get("flags", "").split()),
                   sockets=max(1, len(sockets)), usable_cores=usable_cores(),
                   ghz=ghz or 2.5)  # 2.5 GHz: a typical server base clock when unknown


def cpu_peak_tflops(flags: frozenset[str] | set[str], ghz: float, cores: int) -> dict[str, float]:
    """Peak dense TFLOP/s of `cores` cores from ISA flags and clock (fp32, plus bf16 if any).

    fp32: 32 FLOP/cycle/core with AVX2/AVX-512 FMA (two 256-bit FMA pipes, or AVX-512 on one
    port / Zen 4 double-pumped; Xeons with two 512-bit ports reach 64, so this is
    conservative), 16 with AVX, 8 otherwise. bf16: 2x fp32 with avx512_bf16 (VDPBF16PS does
    two bf16 products per fp32 lane), 1024 FLOP/cycle/core with AMX. On Zen 4 at 2.6 GHz that
    is 0.083 TFLOP/s fp32 per core against 0.079-0.087 measured (bf16: 0.17-0.195 measured).
    """
    fma = "fma" in flags and ("avx2" in flags or "avx512f" in flags)
    fp32 = (32 if fma else 16 if "avx" in flags else 8) * ghz * cores / 1e3
    peaks = {"fp32": round(fp32, 4)}
    if "amx_bf16" in flags:
        peaks["bf16"] = round(1024 * ghz * cores / 1e3, 4)
    elif "avx512_bf16" in flags:
        peaks["bf16"] = round(2 * fp32, 4)
    return peaks


# -- NICs --------------------------------------------------------------------------------------

def detect_nics(*, ib_root: Path = Path("/sys/class/infiniband"),
                net_stats: Mapping[str, Any] | None = None) -> tuple[Nic, ...]:
    """Active RDMA ports (InfiniBand, RoCE or EFA, from sysfs) and physical Ethernet interfaces."""
    nics: list[Nic] = []
    rdma_netdevs: set[str] = set()
    for dev in sorted(ib_root.iterdir()) if ib_root.is_dir() else []:
        rdma_netdevs.update(p.name for p in (dev / "device" / "net").glob("*"))
        ports = sorted((dev / "ports").glob("*"))
        for port in ports:
            state = _read(port / "state") or "ACTIVE"
            rate = re.match(r"\s*([\d.]+)", _read(port / "rate") or "")
            if "ACTIVE" not in state or not rate or float(rate.group(1)) <= 0:
                continue
            layer = (_read(port / "link_layer") or "InfiniBand").lower()
            name = dev.name if len(ports) == 1 else f"{dev.name}/{port.name}"
            # EFA's driver reports no link layer ("Unknown"; rdma-core#884), and its vendor is Amazon's
            efa = layer in ("unknown", "unspecified") or _read(dev / "device" / "vendor") == "0x1d0f"
            kind = "efa" if efa else "roce" if layer == "ethernet" else "infiniband"
            nics.append(Nic(name=name, kind=kind, speed_gbit_s=float(rate.group(1))))
    for name, st in _physical_up(net_stats, rdma_netdevs):
        if st.speed > 0:
            nics.append(Nic(name=name, kind="ethernet", speed_gbit_s=st.speed / 1000))
    return tuple(nics)


def unknown_speed_nics(net_stats: Mapping[str, Any] | None = None) -> tuple[str, ...]:
    """Physical Ethernet interfaces up but without a link speed (a VM's often): no bandwidth, so no `Nic`."""
    return tuple(name for name, st in _physical_up(net_stats, set()) if st.speed <= 0)


def _physical_up(net_stats: Mapping[str, Any] | None, rdma_netdevs: set[str]) -> list[tuple[str, Any]]:
    """(name, psutil stats) of the interfaces that are up and neither virtual nor RDMA ports."""
    stats = psutil.net_if_stats() if net_stats is None else net_stats
    return [(name, st) for name, st in sorted(stats.items())
            if name not in rdma_netdevs and not name.startswith(_VIRTUAL_IFACES) and st.isup]


# -- GPUs --------------------------------------------------------------------------------------

def detect_topology(*, env: Mapping[str, str] | None = None, device: str | None = None) -> Topology:
    """This machine (and its SLURM allocation, if any) as a `Topology`. `device="cpu"` skips GPU
    detection. Without GPUs: device cpu, one rank per usable core, link kind shm, and each rank's
    share of the host's memory and peak FLOP/s."""
    env = os.environ if env is None else env
    slurm = slurm_allocation(env)
    num_nodes = slurm.num_nodes if slurm else 1
    cpu, nics = cpu_info(), detect_nics()
    inter = inter_node_link(nics) if num_nodes > 1 else None
    host = socket.gethostname().split(".")[0] or "localhost"
    gpus = None if device == "cpu" else probe_gpus(env)
    cores = cpu.usable_cores
    if gpus is not None:
        n, note = gpus.usable, ""
        if n < len(gpus.names):  # MIG: one slice per CUDA process (see Gpus.usable)
            note = (f"; {len(gpus.names)} MIG slices visible, a CUDA process enumerates only "
                    "one: one rank, on the first")
            log.warning("%d MIG slices visible, but a CUDA process can use only one (MIG user "
                        "guide): planning one rank on %s; give each job one slice through "
                        "CUDA_VISIBLE_DEVICES=MIG-...", len(gpus.names), gpus.names[0])
        if slurm and slurm.gpus_per_node and slurm.gpus_per_node < n:
            n = slurm.gpus_per_node  # SLURM without device cgroups: use only what was granted
        links = tuple(row[:n] for row in gpus.links[:n])
        nvlinks = tuple(row[:n] for row in gpus.nvlinks[:n]) if gpus.nvlinks else None
        intra = intra_node_link(links, nvlinks=nvlinks, nvlink_gb_s=nvlink_gb_s(gpus.cc), pcie_gb_s=gpus.pcie_gb_s)
        accel = gpu_spec(gpus.names[:n], gpus.mem_bytes[:n], cc=gpus.cc, how=gpus.how, sms=gpus.sms[:n],
                         mig=any(gpus.mig[:n]))
        return Topology(name=f"detected-{host}", device="cuda", num_nodes=num_nodes, devices_per_node=n,
                        intra_node=intra, accelerator=accel, inter_node=inter, cpu_cores_per_node=cores,
                        nics=nics, device_links=links, host=detected_host(gpus.pcie_gb_s),
                        source=f"detected on {host} via {gpus.how}{note}")
    mem_gib = host_mem_gib()
    host_peaks = cpu_peak_tflops(cpu.flags, cpu.ghz, cores)
    accel = DeviceSpec(name=f"{cpu.model} - 1 core per process", mem_gib=round(mem_gib / cores, 2),
                       peak_tflops={k: round(v / cores, 4) for k, v in host_peaks.items()},
                       source=f"one process's share of {cores} usable cores ({cpu.sockets} socket(s), "
                              f"{cpu.ghz:.2f} GHz) and {mem_gib:.1f} GiB; peaks estimated from ISA flags")
    intra = Link(kind="shm", bw_gb_s=1.0, latency_us=100.0,
                 source="gloo over loopback/shared memory; measured 0.5-1.4 GB/s busbw and ~90-110 us per ring "
                        "step for 2-4 ranks on a 2-core host (topologies/cpu-local.yaml)")
    return Topology(name=f"detected-{host}", device="cpu", num_nodes=num_nodes, devices_per_node=cores,
                    accelerator=accel, intra_node=intra, inter_node=inter, cpu_cores_per_node=cores,
                    nics=nics, host=detected_host(None), source=f"detected on {host}: no usable GPU")


# An optimizer step on the host streams its state at the node's memory bandwidth, which no
# probe here reads without timing it: a conservative figure for a server (one socket's DDR4
# or DDR5 channels at ~half their line rate), labelled an assumption wherever it is printed
ASSUMED_HOST_MEM_BW_GB_S = 100.0
# pinned-memory copies reach ~85% of a PCIe link's line rate after encoding (CUDA's
# bandwidthTest: ~55 GB/s host to device on an H100 SXM's gen 5 x16, 63 GB/s line rate)
PINNED_COPY_EFFICIENCY = 0.85


def host_mem_gib() -> float:
    """This node's memory (psutil's total)."""
    return psutil.virtual_memory().total / GIB


def detected_host(pcie_gb_s: float | None) -> Host:
    """This node's host side: psutil's memory; the device link from `pcie_gb_s` (None on a CPU node: its memory)."""
    link = pcie_gb_s * PINNED_COPY_EFFICIENCY if pcie_gb_s is not None else ASSUMED_HOST_MEM_BW_GB_S
    how_link = "" if pcie_gb_s is None else (
        f"device link: NVML's PCIe generation and width at {PINNED_COPY_EFFICIENCY:.0%} (pinned copies); ")
    return Host(mem_gib=round(host_mem_gib(), 1), link_gb_s=link, mem_bw_gb_s=ASSUMED_HOST_MEM_BW_GB_S,
                source=f"memory from psutil; {how_link}memory bandwidth {ASSUMED_HOST_MEM_BW_GB_S:g} GB/s assumed "
                       "(not measured)")

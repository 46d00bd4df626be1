"""Frozen, keyword-only dataclasses that describe hardware: links, devices, NICs, topologies.

Plain values shared by detection and topology files (`hardware`), the planner (`plan`) and
reports (`report`): no torch, no I/O. Each validates itself in `__post_init__` and raises a
`TopologyError`. Units are in the names: `_gib`, `_gb_s` (10^9 bytes per second), `_us`.
Imports only `launcher.errors` and `launcher.specs`; never any other part of dlaunch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from launcher.errors import TopologyError
from launcher.specs import DEVICES, check

# between nodes, the fastest kind first (efa: AWS's Elastic Fabric Adapter)
NETWORK_KINDS = ("infiniband", "roce", "efa", "ethernet")
LINK_KINDS = (
    "nvswitch",  # every GPU pair through NVSwitch
    "nvlink",  # direct NVLink (bridges, meshes)
    "pcie",  # PCIe with peer-to-peer access
    "pcie-nop2p",  # PCIe, copies bounce through host memory
    "shm",  # processes on one host (CPU, gloo over shared memory / loopback)
    *NETWORK_KINDS,
)

@dataclass(frozen=True, kw_only=True)
class Link:
    """One interconnect: achievable bus bandwidth per device in one direction, and latency."""

    kind: str
    bw_gb_s: float
    latency_us: float
    source: str = ""

    def __post_init__(self) -> None:
        check(self.kind in LINK_KINDS, TopologyError,
              f"unknown link kind {self.kind!r}; use one of {', '.join(LINK_KINDS)}")
        check(self.bw_gb_s > 0, TopologyError, f"link {self.kind}: bw_gb_s must be > 0, got {self.bw_gb_s}")
        check(self.latency_us >= 0, TopologyError, f"link {self.kind}: latency_us must be >= 0, got {self.latency_us}")


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator (or, on CPU, one process's share of the host)."""

    name: str
    mem_gib: float
    peak_tflops: Mapping[str, float]  # peak dense TFLOP/s by dtype: keys among fp32, tf32, bf16, fp16
    compute_capability: tuple[int, int] | None = None  # CUDA's (major, minor); None for CPUs
    source: str = ""

    def __post_init__(self) -> None:
        check(self.mem_gib > 0, TopologyError, f"device {self.name}: mem_gib must be > 0, got {self.mem_gib}")
        check("fp32" in self.peak_tflops, TopologyError,
              f"device {self.name}: peak_tflops needs at least an fp32 entry")
        for dtype, tflops in self.peak_tflops.items():
            check(dtype in ("fp32", "tf32", "bf16", "fp16"), TopologyError,
                  f"device {self.name}: unknown dtype {dtype!r} in peak_tflops")
            check(tflops > 0, TopologyError, f"device {self.name}: peak_tflops[{dtype}] must be > 0, got {tflops}")

    @property
    def supports_bf16(self) -> bool:
        """bf16 needs compute capability >= 8.0 on GPUs, a bf16 unit (listed peak) on CPUs."""
        cc = self.compute_capability
        return cc >= (8, 0) if cc is not None else "bf16" in self.peak_tflops


@dataclass(frozen=True, kw_only=True)
class Host:
    """A node's host side, what CPU offload runs on: its memory, the pinned copy bandwidth to each
    device (one direction), and the memory bandwidth an optimizer step on the CPU streams at."""

    mem_gib: float
    link_gb_s: float
    mem_bw_gb_s: float
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("mem_gib", "link_gb_s", "mem_bw_gb_s"):
            check(getattr(self, name) > 0, TopologyError, f"host: {name} must be > 0, got {getattr(self, name)}")

    @property
    def mem_bw_measured(self) -> bool:
        """Whether `mem_bw_gb_s` was measured on this host (plan.resolve), not listed or assumed."""
        return MEASURED_HOST_BW in self.source


# what a host's source says once plan.resolve measured its memory bandwidth
MEASURED_HOST_BW = "GB/s measured (every thread streaming"


@dataclass(frozen=True, kw_only=True)
class Nic:
    """A network interface seen on a node."""

    name: str
    kind: str  # infiniband | roce | efa | ethernet
    speed_gbit_s: float


def rank_threads(cores: int, ranks: int) -> int:
    """The OpenMP threads each of `ranks` processes sharing `cores` cores runs: an equal share,
    at least one (ranks that each take every core fight for them, several times slower)."""
    return max(1, cores // max(1, ranks))


@dataclass(frozen=True, kw_only=True)
class Topology:
    """A machine or cluster: nodes, devices per node, and the links between them."""

    name: str
    device: str
    num_nodes: int
    devices_per_node: int
    accelerator: DeviceSpec
    intra_node: Link
    inter_node: Link | None = None
    cpu_cores_per_node: int = 1
    nics: tuple[Nic, ...] = ()
    device_links: tuple[tuple[str, ...], ...] = ()  # pairwise kinds from detection (row i, column j); none from files
    host: Host | None = None  # None: not described (the plan then proposes no CPU offload)
    source: str = ""

    def __post_init__(self) -> None:
        check(self.device in DEVICES, TopologyError,
              f"topology {self.name}: device must be one of {DEVICES}, got {self.device!r}")
        check(self.num_nodes >= 1, TopologyError, f"topology {self.name}: num_nodes must be >= 1, got {self.num_nodes}")
        check(self.devices_per_node >= 1, TopologyError,
              f"topology {self.name}: devices_per_node must be >= 1, got {self.devices_per_node}")
        check(self.num_nodes == 1 or self.inter_node is not None, TopologyError,
              f"topology {self.name}: {self.num_nodes} nodes need an inter_node link")

    @property
    def world_size(self) -> int:
        """Total number of ranks (one per device)."""
        return self.num_nodes * self.devices_per_node

    @property
    def rank_threads(self) -> int:
        """The OpenMP threads each CPU rank of a node runs (see `rank_threads`)."""
        return rank_threads(self.cpu_cores_per_node, self.devices_per_node)

    def with_shape(self, *, num_nodes: int, devices_per_node: int) -> Topology:
        """The same hardware with a different number of nodes or devices per node."""
        return dataclasses.replace(self, num_nodes=num_nodes, devices_per_node=devices_per_node, device_links=())

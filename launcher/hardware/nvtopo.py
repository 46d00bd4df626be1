"""GPU and network links from facts: `nvidia-smi topo` parsers and the ring `Link` derivation.

Pure functions of text and plain values (no subprocess, no NVML, no sysfs): `detect` feeds
them what it probes, and the tests feed them recorded outputs from real machines
(`tests/data/nvidia-smi-topo/`). Bandwidths derived here are estimates from line rates and the
efficiencies measured for the shipped topologies (`topologies/*.yaml`), as each `source` says.

Never imports plan, backends, jobs, runtime, results or report.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence

from launcher.errors import TopologyError
from launcher.hardware.types import NETWORK_KINDS, DeviceSpec, Link, Nic
from launcher.specs import GIB

log = logging.getLogger(__name__)

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_GPU_LABEL = re.compile(r"GPU\d+")
_PCIE_CODES = ("PIX", "PXB", "PHB", "NODE", "SYS", "SOC")  # SOC: SYS in drivers before 2017
_KIND_RANK = {"nvswitch": 0, "nvlink": 1, "pcie": 2, "pcie-nop2p": 3}
_LATENCY_US = {"nvswitch": 3.0, "nvlink": 3.0, "pcie": 6.0, "pcie-nop2p": 10.0}
# Achievable ring busbw as a fraction of the per-direction line rate, from the shipped files:
# NVLink 370/450 (H100) and 230/300 (A100); PCIe Gen4 with P2P 20/31.5; without P2P 12/31.5.
_NVLINK_EFF, _PCIE_EFF, _NOP2P_EFF = 0.8, 0.65, 0.38
# Achievable busbw per NIC as a fraction of line rate: IB NDR 46-49 of 50 (nccl-tests #267,
# #290); RoCE ~75% (nccl #495); EFA: the fit to collectives measured on 8-GPU nodes with 3.2 Tb/s
# of it (topologies/h100-sxm-8x64node-efa.yaml: 140 GB/s of 400, 31.5 us a ring step), assumed
# for other EFA nodes; TCP sockets: an assumption.
_NET_EFF = {"infiniband": 0.93, "roce": 0.75, "efa": 0.35, "ethernet": 0.6}
_NET_LATENCY_US = {"infiniband": 5.0, "roce": 8.0, "efa": 31.5, "ethernet": 30.0}

# Dense peak TFLOP/s from the vendors' datasheets (with-sparsity numbers halved), the compute
# capability and the full GPU's SM count (None: not needed, no MIG), for GPUs NVML names; first
# match wins, so specific names come first. GeForce cards list FP16/BF16 with FP32 accumulate
# (what training uses; their FP16-accumulate rate is twice that).
_GPU_TABLE: tuple[tuple[str, dict[str, float], tuple[int, int], int | None], ...] = (
    # GB200 NVL72 spec table, per GPU: FP32 80, TF32 2.5 PF and FP16/BF16 5 PF with sparsity;
    # 186 GB HBM3e at 8 TB/s; NVLink 5 (nvidia.com/en-us/data-center/gb200-nvl72)
    (r"GB200", {"fp32": 80, "tf32": 1250, "bf16": 2500, "fp16": 2500}, (10, 0), None),
    # HGX B200 spec table, per GPU: FP32 75, TF32 2.2 PF and FP16/BF16 4.5 PF with sparsity;
    # 180 GB HBM3e at 7.7 TB/s (8 TB/s in the first datasheet); 148 SMs (nvidia.com/en-us/data-center/hgx)
    (r"B200", {"fp32": 75, "tf32": 1100, "bf16": 2250, "fp16": 2250}, (10, 0), 148),
    # NVIDIA RTX Blackwell GPU Architecture whitepaper (GeForce RTX 5090): FP32 104.8, TF32
    # 104.8, FP16/BF16 with FP32 accumulate 209.5 (419 with FP16 accumulate); 170 SMs; 32 GB
    # GDDR7 at 1792 GB/s; no NVLink. The laptop part is a smaller chip (GB203).
    (r"5090(?! Laptop)", {"fp32": 104.8, "tf32": 104.8, "bf16": 209.5, "fp16": 209.5}, (12, 0), 170),
    (r"H100.*PCIe", {"fp32": 51, "tf32": 378, "bf16": 756, "fp16": 756}, (9, 0), 114),
    # H100 NVL and H200 NVL datasheets: FP32 60, TF32 835 and FP16/BF16 1671 with sparsity
    (r"H[12]00 NVL", {"fp32": 60, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5}, (9, 0), 132),
    # H200 (SXM) datasheet: H100 SXM's compute (FP32 67, BF16 1979 with sparsity) with 141 GB
    # HBM3e at 4.8 TB/s (H100 SXM: 80 GB HBM3 at 3.35 TB/s); GH200 the same GPU
    (r"H100|H200|H800", {"fp32": 67, "tf32": 495, "bf16": 989, "fp16": 989}, (9, 0), 132),
    (r"A100|A800", {"fp32": 19.5, "tf32": 156, "bf16": 312, "fp16": 312}, (8, 0), 108),
    (r"L40S", {"fp32": 91.6, "tf32": 183, "bf16": 362, "fp16": 362}, (8, 9), None),
    (r"L40", {"fp32": 90.5, "tf32": 90.5, "bf16": 181, "fp16": 181}, (8, 9), None),
    (r"\bL4\b", {"fp32": 30.3, "tf32": 60, "bf16": 121, "fp16": 121}, (8, 9), None),
    (r"\bA10G?\b", {"fp32": 31.2, "tf32": 62.5, "bf16": 125, "fp16": 125}, (8, 6), None),
    (r"\bA40\b", {"fp32": 37.4, "tf32": 74.8, "bf16": 149.7, "fp16": 149.7}, (8, 6), None),
    (r"A6000", {"fp32": 38.7, "tf32": 77.4, "bf16": 154.8, "fp16": 154.8}, (8, 6), None),
    (r"4090", {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2}, (8, 9), None),
    (r"3090", {"fp32": 35.6, "tf32": 35.6, "bf16": 71, "fp16": 71}, (8, 6), None),
    (r"V100", {"fp32": 15.7, "fp16": 125}, (7, 0), None),
    (r"\bT4\b", {"fp32": 8.1, "fp16": 65}, (7, 5), None),
)
# MIG cuts a GPU into at most 7 compute slices (GPCs): a slice's share when its SM count or the
# full GPU's is unknown (MIG user guide, "Supported MIG Profiles")
_MIG_SLICES = 7
_MIG_PROFILE = re.compile(r"\bMIG (?:(\d+)c\.)?(\d+)g\b")  # 1g.10gb, 1c.3g.40gb, "MIG 2g slice"


def nvlink_gb_s(cc: tuple[int, int] | None) -> float:
    """Line rate of one NVLink lane, GB/s per direction, by compute capability: NVLink 2-4
    (V100, A100, H100/H200) 25 (H100: 18 links, 900 GB/s both ways); the GA10x bridges (8.6)
    14.0625; NVLink 5 (Blackwell data-center GPUs, 10.x) 50 (18 links, 1.8 TB/s both ways,
    900 GB/s each way: NVIDIA's NVLink page and the HGX B200 / GB200 NVL72 spec tables)."""
    return 14.0625 if cc == (8, 6) else 50.0 if cc is not None and cc[0] == 10 else 25.0


# -- between nodes ------------------------------------------------------------------------------

def inter_node_link(nics: Sequence[Nic]) -> Link:
    """The link a ring spanning nodes sees: the node's aggregate NIC bandwidth of the best kind.
    NCCL spreads its channels over all NICs of the fastest kind (one rail each), so a ring crossing
    nodes sees their sum (nccl-tests busbw); with one NIC, that NIC's rate."""
    for kind in NETWORK_KINDS:
        same = [n for n in nics if n.kind == kind]
        if not same:
            continue
        # Ethernet without RDMA: NCCL's socket transport uses one interface at a time
        line = (max if kind == "ethernet" else sum)(n.speed_gbit_s for n in same)
        return Link(kind=kind, bw_gb_s=round(line / 8 * _NET_EFF[kind], 2), latency_us=_NET_LATENCY_US[kind],
                    source=f"detected {len(same)} {kind} NIC(s), {line:g} Gb/s in all; "
                           f"busbw estimated at {_NET_EFF[kind]:.0%} of line rate")
    return Link(kind="ethernet", bw_gb_s=round(10 / 8 * _NET_EFF["ethernet"], 2),
                latency_us=_NET_LATENCY_US["ethernet"], source="no NIC detected; 10 GbE TCP assumed")


# -- nvidia-smi topo parsing -------------------------------------------------------------------

def _matrix(text: str, what: str) -> tuple[tuple[str, ...], ...]:
    lines = [_ANSI.sub("", line) for line in text.splitlines()]
    header = next((i for i, line in enumerate(lines) if line.split()[:1] == ["GPU0"]), None)
    if header is None:
        raise TopologyError(f"{what}: no header row starting with GPU0 found")
    n = sum(1 for t in lines[header].split() if _GPU_LABEL.fullmatch(t))
    rows: list[tuple[str, ...]] = []
    for line in lines[header + 1:]:
        parts = line.split()
        if not parts:
            break  # the matrix ends at the first blank line, before the legend
        if _GPU_LABEL.fullmatch(parts[0]):
            if len(parts) < n + 1:
                raise TopologyError(f"{what}: row {parts[0]} has {len(parts) - 1} cells, expected {n}")
            rows.append(tuple(parts[1:n + 1]))
    if len(rows) != n or any(rows[i][i] != "X" for i in range(n)):
        raise TopologyError(f"{what}: expected a {n}x{n} GPU matrix with X on the diagonal")
    return tuple(rows)


def parse_nvidia_smi_topo(text: str, *, peer_access: bool | Sequence[Sequence[bool | None]]
                          | None = None) -> tuple[tuple[str, ...], ...]:
    """Map `nvidia-smi topo -m` output to a GPU x GPU matrix of LINK_KINDS ("" on the diagonal):
    NV# -> nvlink, or nvswitch when every pair of 3+ GPUs is NV# (a 2-GPU bridge stays nvlink);
    PIX/PXB/PHB/NODE/SYS -> pcie, or pcie-nop2p where `peer_access` (one bool or a matrix, e.g.
    from `parse_nvidia_smi_p2p`) is known False. NIC and CPU columns are ignored."""
    cells = _matrix(text, "nvidia-smi topo -m")
    n = len(cells)
    all_nv = n > 2 and all(cells[i][j].startswith("NV") for i in range(n) for j in range(n) if i != j)

    def kind(i: int, j: int) -> str:
        cell = cells[i][j]
        if i == j:
            return ""
        if cell.startswith("NV"):
            return "nvswitch" if all_nv else "nvlink"
        if cell not in _PCIE_CODES:
            log.warning("nvidia-smi topo: unknown link %r between GPU%d and GPU%d; treated as PCIe", cell, i, j)
        known = peer_access if isinstance(peer_access, bool) or peer_access is None else peer_access[i][j]
        return "pcie-nop2p" if known is False else "pcie"

    return tuple(tuple(kind(i, j) for j in range(n)) for i in range(n))


def parse_nvidia_smi_nvlinks(text: str) -> tuple[tuple[int, ...], ...]:
    """The number of bonded NVLinks per GPU pair in `nvidia-smi topo -m` output (0: none)."""
    cells = _matrix(text, "nvidia-smi topo -m")
    return tuple(tuple(int(m.group(1)) if (m := re.fullmatch(r"NV(\d+)", c)) else 0 for c in row) for row in cells)


def parse_nvidia_smi_p2p(text: str) -> tuple[tuple[bool | None, ...], ...]:
    """`nvidia-smi topo -p2p r` output as peer-read access: OK -> True, X/U -> None, else (CNS, NS...) False."""
    cells = _matrix(text, "nvidia-smi topo -p2p")
    return tuple(tuple(True if c == "OK" else None if c in ("X", "U") else False for c in row) for row in cells)


def _hamiltonian_cycle(n: int, ok: Sequence[Sequence[bool]]) -> bool:
    # Held-Karp reachability: can a ring visit every GPU using only `ok` pairs?
    reach = [0] * (1 << n)  # reach[mask]: bitset of end vertices of paths 0 -> ... over mask
    reach[1] = 1
    for mask in range(1, 1 << n):
        ends = reach[mask]
        if not ends or not mask & 1:
            continue
        for v in range(n):
            if ends >> v & 1:
                for w in range(n):
                    if not mask >> w & 1 and ok[v][w]:
                        reach[mask | 1 << w] |= 1 << w
    full = reach[(1 << n) - 1]
    return any(full >> v & 1 and ok[v][0] for v in range(1, n))


def intra_node_link(links: Sequence[Sequence[str]], *, nvlinks: Sequence[Sequence[int]] | None = None,
                    nvlink_gb_s: float = 25.0, pcie_gb_s: float = 31.5) -> Link:
    """The intra-node `Link` a ring over all GPUs sees: the slowest pair of the best ring order (searched
    up to 10 GPUs, so that e.g. NVLink-bridged pairs are used where a ring can). Per pair: NVLink/NVSwitch
    80% of `nvlink_gb_s` x bonded links (12 when unknown), PCIe with P2P 65% and without P2P 38% of
    `pcie_gb_s` (per direction of the GPUs' PCIe link)."""
    n = len(links)
    if n < 2:
        return Link(kind="pcie", bw_gb_s=round(_PCIE_EFF * pcie_gb_s, 1), latency_us=_LATENCY_US["pcie"],
                    source="single GPU: no peer links; PCIe to the host assumed")

    def pair_bw(i: int, j: int) -> float:
        kind = links[i][j]
        if kind in ("nvswitch", "nvlink"):
            return _NVLINK_EFF * nvlink_gb_s * ((nvlinks[i][j] if nvlinks else 0) or 12)
        return (_NOP2P_EFF if kind == "pcie-nop2p" else _PCIE_EFF) * pcie_gb_s

    pairs = [(i, j) for i in range(n) for j in range(n) if i != j]
    for i, j in pairs:
        if links[i][j] not in _KIND_RANK:
            raise TopologyError(f"GPU{i}-GPU{j}: {links[i][j]!r} is not a GPU link kind")
    if n <= 10:
        best = min(pair_bw(i, j) for i, j in pairs)  # any complete graph has a ring
        for threshold in sorted({pair_bw(i, j) for i, j in pairs}, reverse=True):
            ok = [[i != j and pair_bw(i, j) >= threshold for j in range(n)] for i in range(n)]
            if n == 2 or _hamiltonian_cycle(n, ok):
                best = threshold
                break
        ring = "best ring order"
    else:  # the subset search is exponential; NCCL's ring for big boxes is close to index order
        best = min(pair_bw(i, (i + 1) % n) for i in range(n))
        ring = "ring in index order"
    i, j = min(pairs, key=lambda p: (abs(pair_bw(*p) - best), -_KIND_RANK[links[p[0]][p[1]]]))
    kind = links[i][j]
    return Link(kind=kind, bw_gb_s=round(best, 1), latency_us=_LATENCY_US[kind],
                source=f"detected: the slowest link of the {ring} is {kind} (like GPU{i}-GPU{j}); "
                       "busbw estimated as line rate x the efficiency of the shipped topologies")


# -- GPU models --------------------------------------------------------------------------------

def _mig_share(name: str, sms: int | None, full_sms: int | None) -> tuple[float, str]:
    """A MIG slice's share of its GPU's compute, and how it was found: its SMs over the full GPU's
    (an A100 1g.10gb has 14 of 108), else its compute slices (the name's profile) over 7, else 1/7."""
    if sms and full_sms:
        return min(1.0, sms / full_sms), f"{sms} of {full_sms} SMs"
    profile = _MIG_PROFILE.search(name)
    slices = int(profile.group(1) or profile.group(2)) if profile else 1
    return min(1.0, slices / _MIG_SLICES), f"{slices} of {_MIG_SLICES} compute slices"


def gpu_spec(names: Sequence[str], mem_bytes: Sequence[int], *, cc: tuple[int, int] | None,
             how: str, sms: Sequence[int | None] = (), mig: bool = False) -> DeviceSpec:
    """The `DeviceSpec` to plan for: the first GPU's name, the smallest memory, datasheet peaks (placeholders
    for unknown names). `cc`: the compute capability the driver reported (None: the table's); `how`: the
    probe, for `source`. `mig`: the devices are MIG slices, their peaks the full GPU's scaled by the
    smallest slice's share of its SMs (`sms`, per device)."""
    name = names[0]
    if len(set(names)) > 1:
        log.warning("mixed GPUs %s; planning for %s with the smallest memory", sorted(set(names)), name)
    peaks, note, full_sms = None, f"{how}: {name}", None
    for pattern, table_peaks, table_cc, table_sms in _GPU_TABLE:
        if re.search(pattern, name):
            peaks, cc, full_sms = dict(table_peaks), cc or table_cc, table_sms
            note += "; peak TFLOP/s (dense) from dlaunch's datasheet table"
            break
    if peaks is None:
        cc = cc or (7, 0)
        peaks = {"fp32": 10.0, "fp16": 40.0, **({"bf16": 40.0} if cc >= (8, 0) else {})}
        log.warning("unknown GPU %r: peak TFLOP/s are placeholders; write a topology file", name)
        note += "; unknown GPU: peak TFLOP/s are placeholders"
    assert cc is not None  # narrowing: the table or the placeholder set it
    if cc < (8, 0):  # no bf16/tf32 units before Ampere
        peaks = {k: v for k, v in peaks.items() if k not in ("bf16", "tf32")}
    if mig:
        share, how_share = _mig_share(name, min((s for s in sms if s), default=None), full_sms)
        peaks = {k: round(v * share, 2) for k, v in peaks.items()}
        note += f"; MIG slice: {how_share}, peaks scaled to {share:.0%} of the full GPU's, memory the slice's"
    return DeviceSpec(name=name, mem_gib=round(min(mem_bytes) / GIB, 2), peak_tflops=peaks,
                      compute_capability=cc, source=note)

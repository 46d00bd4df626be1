"""The GPUs of this machine and the links between them, without importing torch on the way:
NVML (nvidia-ml-py) first, `nvidia-smi topo -m` as the fallback, torch's peer-access query
only when torch is already importable and CUDA present.

Never imports plan, backends, jobs, runtime, results or report; torch only inside its last-
resort probe.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from launcher.errors import TopologyError
from launcher.hardware.nvtopo import parse_nvidia_smi_nvlinks, parse_nvidia_smi_p2p, parse_nvidia_smi_topo

log = logging.getLogger(__name__)

_SUBPROCESS_TIMEOUT_S = 10.0
# GB/s per PCIe lane and direction, by generation (after encoding overhead)
_PCIE_LANE_GB_S = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}


@dataclass(frozen=True, kw_only=True)
class Gpus:
    names: tuple[str, ...]
    mem_bytes: tuple[int, ...]
    cc: tuple[int, int] | None
    links: tuple[tuple[str, ...], ...]
    nvlinks: tuple[tuple[int, ...], ...] | None
    pcie_gb_s: float
    how: str


def _visible(count: int, env: Mapping[str, str]) -> list[int]:
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is None:
        return list(range(count))
    items = [x.strip() for x in cvd.split(",") if x.strip()]
    if any(x.startswith("-") for x in items):  # CUDA stops at the first invalid index
        items = items[:next(k for k, x in enumerate(items) if x.startswith("-"))]
    if all(x.isdigit() for x in items):
        return [int(x) for x in items if int(x) < count]
    return list(range(min(count, len(items))))  # UUIDs: keep the count, not the mapping


def _nvml() -> Any:
    try:
        import pynvml  # deferred: optional binding; without it this probe is skipped
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:  # NVMLError_LibraryNotFound on machines without a driver
        log.debug("NVML unavailable: %s", exc)
        return None
    return pynvml


def count_gpus(env: Mapping[str, str] | None = None) -> int:
    """GPUs this process can use (NVML count, limited by CUDA_VISIBLE_DEVICES); 0 without NVML."""
    nv = _nvml()
    if nv is None:
        return 0
    try:
        return len(_visible(nv.nvmlDeviceGetCount(), os.environ if env is None else env))
    except nv.NVMLError as exc:
        log.debug("NVML device count failed: %s", exc)
        return 0
    finally:
        nv.nvmlShutdown()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _bus(value: Any) -> str:
    return _text(value).lower()[-12:]  # NVML pads the PCI domain to 8 digits in some calls


def _nvml_links(nv: Any, handles: list[Any], all_bus: list[str]) -> tuple[list[list[str]],
                                                                              list[list[int]]]:
    n = len(handles)
    bus = [_bus(nv.nvmlDeviceGetPciInfo(h).busId) for h in handles]
    direct = [[0] * n for _ in range(n)]
    to_switch = [0] * n
    for i, h in enumerate(handles):
        for link in range(nv.NVML_NVLINK_MAX_LINKS):
            try:
                if nv.nvmlDeviceGetNvLinkState(h, link) != nv.NVML_FEATURE_ENABLED:
                    continue
                remote = _bus(nv.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId)
            except nv.NVMLError:
                continue  # NotSupported: no NVLink on this GPU or past its last link
            try:
                is_switch = (nv.nvmlDeviceGetNvLinkRemoteDeviceType(h, link)
                             == nv.NVML_NVLINK_DEVICE_TYPE_SWITCH)
            except (nv.NVMLError, AttributeError):  # older drivers: not a GPU -> a switch
                is_switch = remote not in all_bus
            if is_switch:
                to_switch[i] += 1
            elif remote in bus:
                direct[i][bus.index(remote)] += 1
    links = [[""] * n for _ in range(n)]
    counts = [[0] * n for _ in range(n)]
    for i in range(n):
        for j in range(n):
            if i == j:
                continue
            if to_switch[i] and to_switch[j]:
                links[i][j], counts[i][j] = "nvswitch", min(to_switch[i], to_switch[j])
            elif direct[i][j]:
                links[i][j], counts[i][j] = "nvlink", direct[i][j]
            else:
                try:  # index 0 is NVML_P2P_CAPS_INDEX_READ (pynvml spells it as a tuple)
                    ok = nv.nvmlDeviceGetP2PStatus(handles[i], handles[j], 0) == 0
                except nv.NVMLError:
                    ok = None
                links[i][j] = "pcie-nop2p" if ok is False else "pcie"
    return links, counts


def _probe_nvml(env: Mapping[str, str]) -> Gpus | None:
    nv = _nvml()
    if nv is None:
        return None
    try:
        count = nv.nvmlDeviceGetCount()
        all_handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        handles = [all_handles[i] for i in _visible(count, env)]
        if not handles:
            return None
        cc = nv.nvmlDeviceGetCudaComputeCapability(handles[0])
        lanes = []
        for h in handles:
            try:
                gen = nv.nvmlDeviceGetMaxPcieLinkGeneration(h)
                lanes.append(_PCIE_LANE_GB_S.get(gen, 1.969) * nv.nvmlDeviceGetMaxPcieLinkWidth(h))
            except nv.NVMLError:
                lanes.append(_PCIE_LANE_GB_S[4] * 16)
        all_bus = [_bus(nv.nvmlDeviceGetPciInfo(h).busId) for h in all_handles]
        links, counts = _nvml_links(nv, handles, all_bus)
        return Gpus(names=tuple(_text(nv.nvmlDeviceGetName(h)) for h in handles),
                     mem_bytes=tuple(int(nv.nvmlDeviceGetMemoryInfo(h).total) for h in handles),
                     cc=(int(cc[0]), int(cc[1])), links=tuple(map(tuple, links)),
                     nvlinks=tuple(map(tuple, counts)), pcie_gb_s=min(lanes), how="NVML")
    except nv.NVMLError as exc:
        log.warning("NVML query failed (%s); trying nvidia-smi", exc)
        return None
    finally:
        nv.nvmlShutdown()


def _run(argv: list[str]) -> str | None:
    exe = shutil.which(argv[0])
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, *argv[1:]], capture_output=True, text=True, check=False,
                              timeout=_SUBPROCESS_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("%s failed: %s", " ".join(argv), exc)
        return None
    return done.stdout if done.returncode == 0 else None


def _torch_peer_access(n: int) -> list[list[bool | None]] | None:
    # Last resort, and only where torch is installed and sees CUDA: importing it costs seconds.
    if importlib.util.find_spec("torch") is None:
        return None
    import torch  # deferred: seconds to load, and only this last-resort probe needs it

    if not torch.cuda.is_available() or torch.cuda.device_count() < n:
        return None
    return [[None if i == j else bool(torch.cuda.can_device_access_peer(i, j))
             for j in range(n)] for i in range(n)]


def _probe_nvidia_smi(env: Mapping[str, str]) -> Gpus | None:
    query = "--query-gpu=name,memory.total,compute_cap"
    # compute_cap is a newer query field (drivers >= 510): retry without it on older ones
    out = _run(["nvidia-smi", query, "--format=csv,noheader,nounits"]) or _run(
        ["nvidia-smi", query.rsplit(",", 1)[0], "--format=csv,noheader,nounits"])
    if not out or not out.strip():
        return None
    rows = [[c.strip() for c in line.split(",")] for line in out.strip().splitlines()]
    keep = _visible(len(rows), env)
    rows = [rows[i] for i in keep]
    if not rows:
        return None
    n = len(rows)
    links: tuple[tuple[str, ...], ...] = tuple(
        tuple("" if i == j else "pcie" for j in range(n)) for i in range(n))
    nvlinks = None
    topo = _run(["nvidia-smi", "topo", "-m"])
    try:
        if topo:
            p2p_text = _run(["nvidia-smi", "topo", "-p2p", "r"])
            peer = parse_nvidia_smi_p2p(p2p_text) if p2p_text else _torch_peer_access(n)
            full = parse_nvidia_smi_topo(topo, peer_access=peer)
            counts = parse_nvidia_smi_nvlinks(topo)
            links = tuple(tuple(full[i][j] for j in keep) for i in keep)
            nvlinks = tuple(tuple(counts[i][j] for j in keep) for i in keep)
    except (TopologyError, IndexError) as exc:
        log.warning("could not read nvidia-smi topo output (%s); assuming PCIe", exc)
    cc = None
    if len(rows[0]) > 2 and re.fullmatch(r"\d+\.\d+", rows[0][2]):
        cc = (int(rows[0][2].split(".")[0]), int(rows[0][2].split(".")[1]))
    return Gpus(names=tuple(r[0] for r in rows),
                 mem_bytes=tuple(int(float(r[1]) * 2**20) for r in rows),
                 cc=cc, links=links, nvlinks=nvlinks, pcie_gb_s=_PCIE_LANE_GB_S[4] * 16,
                 how="nvidia-smi")


# -- the machine -------------------------------------------------------------------------------

def probe_gpus(env: Mapping[str, str]) -> Gpus | None:
    """The visible GPUs through NVML, else nvidia-smi; None when there are none."""
    return _probe_nvml(env) or _probe_nvidia_smi(env)

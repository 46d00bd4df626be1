"""The GPUs of this machine as NVML (nvidia-ml-py) reports them: names, memory, compute
capability, PCIe and per-pair links, a MIG-enabled GPU as its slices (each with its memory and
SMs). The first of launcher.hardware.gpu_probe's sources; its fallbacks fill the same `Gpus`.

Never imports plan, backends, jobs, runtime, results or report; never torch.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from launcher.hardware.visible import CudaDevice, visible_devices

log = logging.getLogger(__name__)

# GB/s per PCIe lane and direction, by generation (after encoding overhead)
PCIE_LANE_GB_S = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
PCIE_UNKNOWN_GB_S = PCIE_LANE_GB_S[4] * 16  # a link no probe reports: x16 gen 4
_NO_P2P_MIG = "pcie-nop2p"  # MIG slices have no peer access (MIG user guide): no NVLink, no P2P


@dataclass(frozen=True, kw_only=True)
class Gpus:
    """The CUDA devices visible here, one entry per whole GPU or MIG slice, in CUDA's order."""

    names: tuple[str, ...]
    mem_bytes: tuple[int, ...]
    cc: tuple[int, int] | None
    links: tuple[tuple[str, ...], ...]
    nvlinks: tuple[tuple[int, ...], ...] | None
    pcie_gb_s: float
    how: str
    sms: tuple[int | None, ...] = ()  # streaming multiprocessors per device (None: not reported)
    mig: tuple[bool, ...] = ()  # per device: is it a MIG slice (empty: none is)

    @property
    def usable(self) -> int:
        """How many of them one job's ranks can use: all, except that a CUDA process enumerates
        only one MIG device whatever CUDA_VISIBLE_DEVICES lists (MIG user guide, "CUDA Device
        Enumeration"; torch.cuda.device_count() is 1), and every rank inherits the same list."""
        return 1 if any(self.mig) else len(self.names)


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


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _bus(value: Any) -> str:
    return _text(value).lower()[-12:]  # NVML pads the PCI domain to 8 digits in some calls


def _nvml_links(nv: Any, handles: list[Any], all_bus: list[str]) -> tuple[list[list[str]], list[list[int]]]:
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
                is_switch = nv.nvmlDeviceGetNvLinkRemoteDeviceType(h, link) == nv.NVML_NVLINK_DEVICE_TYPE_SWITCH
            except (nv.NVMLError, AttributeError):  # older drivers: not a GPU -> a switch
                is_switch = remote not in all_bus
            if is_switch:
                to_switch[i] += 1
            elif remote in bus:
                direct[i][bus.index(remote)] += 1
    links = [[""] * n for _ in range(n)]
    counts = [[0] * n for _ in range(n)]
    for i, j in itertools.permutations(range(n), 2):
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


def _uuid(nv: Any, handle: Any) -> str:
    try:
        return _text(nv.nvmlDeviceGetUUID(handle))
    except (nv.NVMLError, AttributeError):  # unknown: CUDA_VISIBLE_DEVICES UUIDs match nothing
        return ""


def _mig_enabled(nv: Any, handle: Any) -> bool:
    try:
        return bool(nv.nvmlDeviceGetMigMode(handle)[0] == nv.NVML_DEVICE_MIG_ENABLE)
    except (nv.NVMLError, AttributeError):  # NotSupported before Ampere; old bindings
        return False


def _nvml_devices(nv: Any) -> tuple[list[CudaDevice], list[Any], list[Any]]:
    """Every CUDA device NVML knows, in its order (a MIG GPU as its slices), its handles, and all GPUs' handles."""
    gpu_handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
    devices: list[CudaDevice] = []
    handles: list[Any] = []
    for i, h in enumerate(gpu_handles):
        gpu_uuid = _uuid(nv, h)
        if not _mig_enabled(nv, h):
            devices.append(CudaDevice(gpu=i, gpu_uuid=gpu_uuid, uuid=gpu_uuid))
            handles.append(h)
            continue
        for k in range(nv.nvmlDeviceGetMaxMigDeviceCount(h)):
            try:
                m = nv.nvmlDeviceGetMigDeviceHandleByIndex(h, k)
            except nv.NVMLError:
                continue  # NotFound: no compute instance at this index
            devices.append(CudaDevice(gpu=i, gpu_uuid=gpu_uuid, uuid=_uuid(nv, m), mig=True))
            handles.append(m)
    return devices, handles, gpu_handles


def _mig_name(nv: Any, handle: Any, parent_name: str) -> tuple[str, int | None]:
    """A MIG slice's name (NVML's names it with its profile: "... MIG 1g.10gb") and SMs."""
    try:
        name = _text(nv.nvmlDeviceGetName(handle))
    except nv.NVMLError:
        name = ""
    try:
        attrs = nv.nvmlDeviceGetAttributes(handle)
        sms, slices = int(attrs.multiprocessorCount), int(attrs.gpuInstanceSliceCount)
    except (nv.NVMLError, AttributeError):
        sms, slices = None, 0
    if "MIG" not in name:
        name = f"{parent_name} MIG {slices}g slice" if slices else f"{parent_name} MIG slice"
    return name, sms or None


def probe_nvml(env: Mapping[str, str]) -> Gpus | None:
    """The visible CUDA devices as NVML sees them; None without NVML or devices, or on an error."""
    nv = _nvml()
    if nv is None:
        return None
    try:
        all_devices, all_handles, gpu_handles = _nvml_devices(nv)
        keep = visible_devices(all_devices, env.get("CUDA_VISIBLE_DEVICES"))
        if not keep:
            return None
        devices = [all_devices[k] for k in keep]
        handles = [all_handles[k] for k in keep]
        parents = [gpu_handles[d.gpu] for d in devices]
        gpu_names = [_text(nv.nvmlDeviceGetName(h)) for h in parents]
        names = list(gpu_names)
        sms: list[int | None] = [None] * len(devices)
        for k, d in enumerate(devices):
            if d.mig:
                names[k], sms[k] = _mig_name(nv, handles[k], gpu_names[k])
        warn_device_order(env, gpu_names)
        cc = nv.nvmlDeviceGetCudaComputeCapability(parents[0])
        lanes = []
        for h in parents:
            try:
                gen = nv.nvmlDeviceGetMaxPcieLinkGeneration(h)
                lanes.append(PCIE_LANE_GB_S.get(gen, 1.969) * nv.nvmlDeviceGetMaxPcieLinkWidth(h))
            except nv.NVMLError:
                lanes.append(PCIE_UNKNOWN_GB_S)
        mig = tuple(d.mig for d in devices)
        n = len(devices)
        if any(mig):
            links = [["" if i == j else _NO_P2P_MIG for j in range(n)] for i in range(n)]
            counts = [[0] * n for _ in range(n)]
        else:
            all_bus = [_bus(nv.nvmlDeviceGetPciInfo(h).busId) for h in gpu_handles]
            links, counts = _nvml_links(nv, handles, all_bus)
        return Gpus(names=tuple(names), mem_bytes=tuple(int(nv.nvmlDeviceGetMemoryInfo(h).total) for h in handles),
                    cc=(int(cc[0]), int(cc[1])), links=tuple(map(tuple, links)), nvlinks=tuple(map(tuple, counts)),
                    pcie_gb_s=min(lanes), how="NVML", sms=tuple(sms), mig=mig)
    except nv.NVMLError as exc:
        log.warning("NVML query failed (%s); trying nvidia-smi", exc)
        return None
    finally:
        nv.nvmlShutdown()


def warn_device_order(env: Mapping[str, str], names: Sequence[str]) -> None:
    # dlaunch sets PCI_BUS_ID for its ranks unless the user chose an order; a chosen fastest-
    # first order numbers a mixed host's GPUs differently from NVML
    order = env.get("CUDA_DEVICE_ORDER", "PCI_BUS_ID").strip().upper()
    if order != "PCI_BUS_ID" and len(set(names)) > 1:
        log.warning("CUDA_DEVICE_ORDER=%s on a host with mixed GPUs (%s): CUDA's device numbers differ from "
                    "NVML's, which dlaunch plans with; set CUDA_DEVICE_ORDER=PCI_BUS_ID", order,
                    ", ".join(sorted(set(names))))


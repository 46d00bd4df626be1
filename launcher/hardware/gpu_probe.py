"""The GPUs of this machine and the links between them, without importing torch here: NVML
(nvidia-ml-py) first, `nvidia-smi` as the fallback, and where neither works (a container given
the compute capability but not NVML) torch in a child process, which also answers peer access
where nvidia-smi cannot.

What CUDA will hand the ranks is what is planned for: the devices `CUDA_VISIBLE_DEVICES`
selects, read as CUDA reads it with `CUDA_DEVICE_ORDER=PCI_BUS_ID` (NVML's order, which dlaunch
sets for the ranks: launcher.hardware.visible), and a MIG slice as the slice it is (its memory, its
share of the SMs), never as its whole GPU.

Never imports plan, backends, jobs, runtime, results or report; never torch in this process
(CUDA initialised in the launcher would break the ranks it forks).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.errors import TopologyError
from launcher.hardware.nvtopo import parse_nvidia_smi_nvlinks, parse_nvidia_smi_p2p, parse_nvidia_smi_topo
from launcher.hardware.visible import CudaDevice, cuda_order_env, visible_devices, visible_gpus  # noqa: F401

log = logging.getLogger(__name__)

_SUBPROCESS_TIMEOUT_S = 10.0
# importing torch takes 1.5-2 s, initialising CUDA on 8 GPUs several more
_TORCH_PROBE_TIMEOUT_S = 60.0
# GB/s per PCIe lane and direction, by generation (after encoding overhead)
_PCIE_LANE_GB_S = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
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
    # streaming multiprocessors per device, where known (None: not reported)
    sms: tuple[int | None, ...] = ()
    # per device: is it a MIG slice (empty: none is)
    mig: tuple[bool, ...] = ()

    @property
    def usable(self) -> int:
        """How many of them one job's ranks can use: all, except that a CUDA process enumerates
        only one MIG device whatever CUDA_VISIBLE_DEVICES lists (MIG user guide, "CUDA Device
        Enumeration"; torch.cuda.device_count() is 1), and every rank inherits the same list."""
        return 1 if any(self.mig) else len(self.names)


# -- NVML --------------------------------------------------------------------------------------

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
    """CUDA devices one job's ranks can use here (NVML, else nvidia-smi, else torch in a child
    process; limited by CUDA_VISIBLE_DEVICES; one under MIG); 0 when there are none."""
    gpus = probe_gpus(os.environ if env is None else env)
    return gpus.usable if gpus else 0


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
    """Every CUDA device NVML knows, in its order (a MIG-enabled GPU as its slices, none if it
    has no instances yet), with each device's handle and the handles of all GPUs."""
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


def _probe_nvml(env: Mapping[str, str]) -> Gpus | None:
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
        _warn_device_order(env, gpu_names)
        cc = nv.nvmlDeviceGetCudaComputeCapability(parents[0])
        lanes = []
        for h in parents:
            try:
                gen = nv.nvmlDeviceGetMaxPcieLinkGeneration(h)
                lanes.append(_PCIE_LANE_GB_S.get(gen, 1.969) * nv.nvmlDeviceGetMaxPcieLinkWidth(h))
            except nv.NVMLError:
                lanes.append(_PCIE_LANE_GB_S[4] * 16)
        mig = tuple(d.mig for d in devices)
        n = len(devices)
        if any(mig):
            links = [["" if i == j else _NO_P2P_MIG for j in range(n)] for i in range(n)]
            counts = [[0] * n for _ in range(n)]
        else:
            all_bus = [_bus(nv.nvmlDeviceGetPciInfo(h).busId) for h in gpu_handles]
            links, counts = _nvml_links(nv, handles, all_bus)
        return Gpus(names=tuple(names),
                    mem_bytes=tuple(int(nv.nvmlDeviceGetMemoryInfo(h).total) for h in handles),
                    cc=(int(cc[0]), int(cc[1])), links=tuple(map(tuple, links)),
                    nvlinks=tuple(map(tuple, counts)), pcie_gb_s=min(lanes), how="NVML",
                    sms=tuple(sms), mig=mig)
    except nv.NVMLError as exc:
        log.warning("NVML query failed (%s); trying nvidia-smi", exc)
        return None
    finally:
        nv.nvmlShutdown()


def _warn_device_order(env: Mapping[str, str], names: Sequence[str]) -> None:
    # dlaunch sets PCI_BUS_ID for its ranks unless the user chose an order; a chosen fastest-
    # first order numbers a mixed host's GPUs differently from NVML
    order = env.get("CUDA_DEVICE_ORDER", "PCI_BUS_ID").strip().upper()
    if order != "PCI_BUS_ID" and len(set(names)) > 1:
        log.warning("CUDA_DEVICE_ORDER=%s on a host with mixed GPUs (%s): CUDA's device numbers "
                    "differ from NVML's, which dlaunch plans with; set CUDA_DEVICE_ORDER="
                    "PCI_BUS_ID", order, ", ".join(sorted(set(names))))


# -- nvidia-smi --------------------------------------------------------------------------------

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


def _without_peer_access(links: tuple[tuple[str, ...], ...],
                         cuda: Gpus | None) -> tuple[tuple[str, ...], ...]:
    """`links` with the PCIe pairs CUDA reports no peer access between (`cuda`: the same
    visible devices, as the torch probe saw them) marked pcie-nop2p."""
    if cuda is None or len(cuda.links) != len(links):
        return links
    return tuple(tuple("pcie-nop2p" if kind == "pcie" and cuda.links[i][j] == "pcie-nop2p"
                       else kind for j, kind in enumerate(row)) for i, row in enumerate(links))


def _csv_column(argv: list[str]) -> list[str] | None:
    out = _run(argv)
    return [line.strip() for line in out.strip().splitlines()] if out and out.strip() else None


def _probe_nvidia_smi(env: Mapping[str, str]) -> Gpus | None:
    query = "--query-gpu=name,memory.total,compute_cap"
    # compute_cap is a newer query field (drivers >= 510): retry without it on older ones
    out = _run(["nvidia-smi", query, "--format=csv,noheader,nounits"]) or _run(
        ["nvidia-smi", query.rsplit(",", 1)[0], "--format=csv,noheader,nounits"])
    if not out or not out.strip():
        return None
    rows = [[c.strip() for c in line.split(",")] for line in out.strip().splitlines()]
    uuids = None
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd and any(x.strip().startswith(("GPU-", "MIG-")) for x in cvd.split(",")):
        uuids = _csv_column(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"])
        if uuids is not None and len(uuids) != len(rows):
            uuids = None
    keep = visible_gpus(len(rows), env, uuids)
    mig_modes = _csv_column(["nvidia-smi", "--query-gpu=mig.mode.current",
                             "--format=csv,noheader"]) or []
    if any(mig_modes[i] == "Enabled" for i in keep if i < len(mig_modes)) or (
            cvd and "MIG-" in cvd):
        # --query-gpu describes whole GPUs: a MIG slice would be planned with its GPU's memory
        log.info("nvidia-smi: MIG slices visible; sizing them through CUDA instead")
        return None
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
            full = parse_nvidia_smi_topo(
                topo, peer_access=parse_nvidia_smi_p2p(p2p_text) if p2p_text else None)
            counts = parse_nvidia_smi_nvlinks(topo)
            links = tuple(tuple(full[i][j] for j in keep) for i in keep)
            nvlinks = tuple(tuple(counts[i][j] for j in keep) for i in keep)
            if not p2p_text:  # older drivers: CUDA's peer access, asked in a child process
                links = _without_peer_access(links, _probe_torch(env))
    except (TopologyError, IndexError) as exc:
        log.warning("could not read nvidia-smi topo output (%s); assuming PCIe", exc)
    cc = None
    if len(rows[0]) > 2 and re.fullmatch(r"\d+\.\d+", rows[0][2]):
        cc = (int(rows[0][2].split(".")[0]), int(rows[0][2].split(".")[1]))
    _warn_device_order(env, [r[0] for r in rows])
    return Gpus(names=tuple(r[0] for r in rows),
                mem_bytes=tuple(int(float(r[1]) * 2**20) for r in rows),
                cc=cc, links=links, nvlinks=nvlinks, pcie_gb_s=_PCIE_LANE_GB_S[4] * 16,
                how="nvidia-smi")


# -- torch, in a child process -----------------------------------------------------------------

# Run by `sys.executable -c` with the caller's CUDA_VISIBLE_DEVICES: CUDA itself applies it
# (MIG UUIDs included) and names a MIG slice "<GPU> MIG 1g.10gb" with the slice's memory and SMs.
_TORCH_PROBE = """
import json, torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
props = [torch.cuda.get_device_properties(i) for i in range(n)]
print(json.dumps({
    "devices": [{"name": p.name, "total_memory": int(p.total_memory), "major": int(p.major),
                 "minor": int(p.minor), "sms": int(getattr(p, "multi_processor_count", 0))}
                for p in props],
    "peer": [[None if i == j else bool(torch.cuda.can_device_access_peer(i, j))
              for j in range(n)] for i in range(n)],
}))
"""
# results by (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER): the GPUs of a host do not change while
# dlaunch runs, and each probe costs seconds
_TORCH_CACHE: dict[tuple[str | None, str | None], Gpus | None] = {}


def _nvidia_device_nodes(dev: Path = Path("/dev")) -> bool:
    """Whether an NVIDIA GPU's device node is here (/dev/nvidia0 ...): a container given the
    compute capability has them even without NVML; without them CUDA has nothing to open."""
    return any(dev.glob("nvidia[0-9]*"))


def _probe_torch(env: Mapping[str, str]) -> Gpus | None:
    """The GPUs as CUDA sees them, from torch in a child process (this one must not initialise
    CUDA); only where NVIDIA device nodes exist and torch is installed."""
    cvd, order = env.get("CUDA_VISIBLE_DEVICES"), env.get("CUDA_DEVICE_ORDER")
    if cvd is not None and not cvd.strip():
        return None
    if not _nvidia_device_nodes() or importlib.util.find_spec("torch") is None:
        return None
    key = (cvd, order)
    if key not in _TORCH_CACHE:
        _TORCH_CACHE[key] = _run_torch_probe(env)
    return _TORCH_CACHE[key]


def _run_torch_probe(env: Mapping[str, str]) -> Gpus | None:
    child = {k: v for k, v in os.environ.items()
             if k not in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")}
    child.update({k: env[k] for k in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER") if k in env})
    child.update(cuda_order_env(env))  # number the devices as the ranks will
    try:
        done = subprocess.run([sys.executable, "-c", _TORCH_PROBE], env=child, text=True,
                              capture_output=True, check=False, timeout=_TORCH_PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("probing the GPUs through torch failed: %s", exc)
        return None
    try:
        found = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None
        devices, peer = (found["devices"], found["peer"]) if found else ([], [])
    except (ValueError, IndexError, KeyError, TypeError) as exc:
        log.warning("probing the GPUs through torch gave no answer (%s): %s", exc,
                    done.stderr.strip()[-300:])
        return None
    if not devices:
        if done.returncode != 0:
            log.warning("probing the GPUs through torch failed: %s", done.stderr.strip()[-300:])
        return None
    n = len(devices)
    links = tuple(tuple("" if i == j else "pcie-nop2p" if peer[i][j] is False else "pcie"
                        for j in range(n)) for i in range(n))
    mig = tuple("MIG" in d["name"] or (env.get("CUDA_VISIBLE_DEVICES") or "").strip()
                .startswith("MIG-") for d in devices)
    log.info("no NVML here: %d GPU(s) found through torch in a child process; NVLink unknown, "
             "PCIe assumed", n)
    return Gpus(names=tuple(d["name"] for d in devices),
                mem_bytes=tuple(int(d["total_memory"]) for d in devices),
                cc=(int(devices[0]["major"]), int(devices[0]["minor"])), links=links,
                nvlinks=None, pcie_gb_s=_PCIE_LANE_GB_S[4] * 16, how="torch (no NVML)",
                sms=tuple(int(d["sms"]) or None for d in devices), mig=mig)


# -- the machine -------------------------------------------------------------------------------

def probe_gpus(env: Mapping[str, str]) -> Gpus | None:
    """The visible CUDA devices through NVML, else nvidia-smi, else torch in a child process;
    None when there are none."""
    return _probe_nvml(env) or _probe_nvidia_smi(env) or _probe_torch(env)

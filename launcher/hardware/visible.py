"""Which devices CUDA hands the ranks: `CUDA_VISIBLE_DEVICES` read as CUDA reads it (indices in
PCI bus order, GPU-/MIG- UUIDs and their prefixes, a GPU's index selecting its MIG slices), and
the `CUDA_DEVICE_ORDER` dlaunch sets so that cuda:i is NVML's GPU i. Pure: environment strings
and device lists in, positions out (the probes in launcher.hardware.gpu_probe use it).

Never imports anything of dlaunch; never torch.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)


def cuda_order_env(user_env: Mapping[str, str]) -> dict[str, str]:
    """`CUDA_DEVICE_ORDER=PCI_BUS_ID` for CUDA ranks unless `user_env` chose an order: CUDA numbers devices
    fastest first by default, NVML (and so dlaunch's detection and its reading of CUDA_VISIBLE_DEVICES) by
    PCI bus, so on a host with mixed GPUs cuda:0 would be another GPU than the one planned for."""
    return {} if "CUDA_DEVICE_ORDER" in user_env else {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


@dataclass(frozen=True, kw_only=True)
class CudaDevice:
    """One device CUDA can be handed: a whole GPU (NVML index `gpu`) or a MIG slice of it."""

    gpu: int
    gpu_uuid: str = ""  # the GPU's GPU-... UUID ("" when unknown)
    uuid: str = ""  # this device's: the GPU's, or the slice's MIG-... ("" when unknown)
    mig: bool = False


def visible_devices(devices: Sequence[CudaDevice], cvd: str | None) -> list[int]:
    """The positions in `devices` (NVML order, a MIG-enabled GPU as its slices) that CUDA_VISIBLE_DEVICES=`cvd`
    selects, in its order, as CUDA reads it in PCI bus order. Unset: every device. Each entry is an index
    (leading digits, as strtoul reads them) of a whole GPU, a GPU-... or MIG-... UUID or a unique prefix of
    one; a GPU's index or UUID selects all its MIG slices. The list ends at the first entry that names no
    device (negative, out of range, unknown or ambiguous), and a device named twice hides every device
    (CUDA's rules, as torch.cuda._parse_visible_devices mirrors them)."""
    if cvd is None:
        return list(range(len(devices)))
    gpus = sorted({d.gpu for d in devices})
    out: list[int] = []
    for raw in cvd.split(","):
        token = raw.strip()
        digits = re.match(r"\d+", token)
        if digits:
            index = int(digits.group())
            if index >= len(gpus):
                break
            picked = [k for k, d in enumerate(devices) if d.gpu == gpus[index]]
        elif token.startswith("GPU-"):
            owners = {d.gpu for d in devices if d.gpu_uuid.lower().startswith(token.lower())}
            if len(owners) != 1:
                break
            picked = [k for k, d in enumerate(devices) if d.gpu in owners]
        elif token.startswith("MIG-"):
            picked = [k for k, d in enumerate(devices) if d.mig and d.uuid.lower().startswith(token.lower())]
            if len(picked) != 1:
                if token.startswith("MIG-GPU-"):
                    log.warning("CUDA_VISIBLE_DEVICES: %s is a CUDA 11.0 MIG name; name MIG "
                                "devices by their MIG-... UUID (nvidia-smi -L)", token)
                break
        else:
            break
        if set(picked) & set(out):
            return []
        out += picked
    return out


def visible_gpus(count: int, env: Mapping[str, str], uuids: Sequence[str] | None = None) -> list[int]:
    """Which of `count` GPUs (NVML order, their `uuids` where known) CUDA_VISIBLE_DEVICES
    selects; without UUIDs a list of UUIDs keeps its length, not its mapping."""
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if uuids is None and cvd is not None and any(x.strip().startswith(("GPU-", "MIG-")) for x in cvd.split(",")):
        return list(range(min(count, len([x for x in cvd.split(",") if x.strip()]))))
    ids = list(uuids) if uuids is not None else [""] * count
    return visible_devices([CudaDevice(gpu=i, gpu_uuid=u, uuid=u) for i, u in enumerate(ids)], cvd)

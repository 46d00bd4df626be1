"""The GPUs of this machine and the links between them, without importing torch here: NVML first
(launcher.hardware.nvml_probe), `nvidia-smi` as the fallback, and where neither works (a container
given the compute capability but not NVML) torch in a child process, which also answers peer access
where nvidia-smi cannot. What CUDA will hand the ranks is what is planned for: the devices
`CUDA_VISIBLE_DEVICES` selects, read as CUDA reads it in NVML's order (launcher.hardware.visible),
and a MIG slice as the slice it is (its memory, its share of the SMs), never as its whole GPU.

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
from collections.abc import Mapping
from pathlib import Path

from launcher.errors import TopologyError
from launcher.hardware import nvml_probe
from launcher.hardware.nvml_probe import PCIE_UNKNOWN_GB_S, Gpus, warn_device_order
from launcher.hardware.nvtopo import parse_nvidia_smi_nvlinks, parse_nvidia_smi_p2p, parse_nvidia_smi_topo
from launcher.hardware.visible import cuda_order_env, visible_gpus

log = logging.getLogger(__name__)

_SUBPROCESS_TIMEOUT_S = 10.0
# importing torch takes 1.5-2 s, initialising CUDA on 8 GPUs several more
_TORCH_PROBE_TIMEOUT_S = 60.0


def probe_gpus(env: Mapping[str, str]) -> Gpus | None:
    """The visible CUDA devices through NVML, else nvidia-smi, else torch in a child; None if none."""
    return nvml_probe.probe_nvml(env) or _probe_nvidia_smi(env) or _probe_torch(env)


def count_gpus(env: Mapping[str, str] | None = None) -> int:
    """CUDA devices one job's ranks can use here (as CUDA_VISIBLE_DEVICES limits them; one under MIG)."""
    gpus = probe_gpus(os.environ if env is None else env)
    return gpus.usable if gpus else 0


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


def _without_peer_access(links: tuple[tuple[str, ...], ...], cuda: Gpus | None) -> tuple[tuple[str, ...], ...]:
    """`links` with the PCIe pairs the torch probe (`cuda`) found without peer access marked pcie-nop2p."""
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
    lines = _csv_column(["nvidia-smi", query, "--format=csv,noheader,nounits"]) or _csv_column(
        ["nvidia-smi", query.rsplit(",", 1)[0], "--format=csv,noheader,nounits"])
    if not lines:
        return None
    rows = [[c.strip() for c in line.split(",")] for line in lines]
    uuids = None
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd and any(x.strip().startswith(("GPU-", "MIG-")) for x in cvd.split(",")):
        uuids = _csv_column(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"])
        if uuids is not None and len(uuids) != len(rows):
            uuids = None
    keep = visible_gpus(len(rows), env, uuids)
    mig_modes = _csv_column(["nvidia-smi", "--query-gpu=mig.mode.current", "--format=csv,noheader"]) or []
    if any(mig_modes[i] == "Enabled" for i in keep if i < len(mig_modes)) or (cvd and "MIG-" in cvd):
        # --query-gpu describes whole GPUs: a MIG slice would be planned with its GPU's memory
        log.info("nvidia-smi: MIG slices visible; sizing them through CUDA instead")
        return None
    rows = [rows[i] for i in keep]
    if not rows:
        return None
    n = len(rows)
    links: tuple[tuple[str, ...], ...] = tuple(tuple("" if i == j else "pcie" for j in range(n)) for i in range(n))
    nvlinks = None
    topo = _run(["nvidia-smi", "topo", "-m"])
    try:
        if topo:
            p2p_text = _run(["nvidia-smi", "topo", "-p2p", "r"])
            full = parse_nvidia_smi_topo(topo, peer_access=parse_nvidia_smi_p2p(p2p_text) if p2p_text else None)
            counts = parse_nvidia_smi_nvlinks(topo)
            links = tuple(tuple(full[i][j] for j in keep) for i in keep)
            nvlinks = tuple(tuple(counts[i][j] for j in keep) for i in keep)
            if not p2p_text:  # older drivers: CUDA's peer access, asked in a child process
                links = _without_peer_access(links, _probe_torch(env))
    except (TopologyError, IndexError) as exc:
        log.warning("could not read nvidia-smi topo output (%s); assuming PCIe", exc)
    cc_match = re.fullmatch(r"(\d+)\.(\d+)", rows[0][2]) if len(rows[0]) > 2 else None
    cc = (int(cc_match[1]), int(cc_match[2])) if cc_match else None
    warn_device_order(env, [r[0] for r in rows])
    return Gpus(names=tuple(r[0] for r in rows), mem_bytes=tuple(int(float(r[1]) * 2**20) for r in rows),
                cc=cc, links=links, nvlinks=nvlinks, pcie_gb_s=PCIE_UNKNOWN_GB_S, how="nvidia-smi")


# -- torch, in a child process -----------------------------------------------------------------

# Run by `sys.executable -c` with the caller's CUDA_VISIBLE_DEVICES: CUDA itself applies it
# (MIG UUIDs included) and names a MIG slice "<GPU> MIG 1g.10gb" with the slice's memory and SMs.
_TORCH_PROBE = """
import json, torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
props = [torch.cuda.get_device_properties(i) for i in range(n)]
devices = [{"name": p.name, "total_memory": int(p.total_memory), "major": int(p.major), "minor": int(p.minor),
            "sms": int(getattr(p, "multi_processor_count", 0))} for p in props]
peer = [[None if i == j else bool(torch.cuda.can_device_access_peer(i, j)) for j in range(n)] for i in range(n)]
print(json.dumps({"devices": devices, "peer": peer}))
"""
# results by (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER): the GPUs of a host do not change while
# dlaunch runs, and each probe costs seconds
_TORCH_CACHE: dict[tuple[str | None, str | None], Gpus | None] = {}


def _nvidia_device_nodes(dev: Path = Path("/dev")) -> bool:
    """Whether an NVIDIA GPU's device node is here (/dev/nvidia0 ...): a container given the
    compute capability has them even without NVML; without them CUDA has nothing to open."""
    return any(dev.glob("nvidia[0-9]*"))


def _probe_torch(env: Mapping[str, str]) -> Gpus | None:
    """The GPUs as CUDA sees them, from torch in a child process, where device nodes and torch exist."""
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if (cvd is not None and not cvd.strip()) or not _nvidia_device_nodes() or importlib.util.find_spec("torch") is None:
        return None
    key = (cvd, env.get("CUDA_DEVICE_ORDER"))
    if key not in _TORCH_CACHE:
        _TORCH_CACHE[key] = _run_torch_probe(env)
    return _TORCH_CACHE[key]


def _run_torch_probe(env: Mapping[str, str]) -> Gpus | None:
    child = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")}
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
        log.warning("probing the GPUs through torch gave no answer (%s): %s", exc, done.stderr.strip()[-300:])
        return None
    if not devices:
        if done.returncode != 0:
            log.warning("probing the GPUs through torch failed: %s", done.stderr.strip()[-300:])
        return None
    n = len(devices)
    links = tuple(tuple("" if i == j else "pcie-nop2p" if peer[i][j] is False else "pcie"
                        for j in range(n)) for i in range(n))
    mig = tuple("MIG" in d["name"] or (env.get("CUDA_VISIBLE_DEVICES") or "").strip().startswith("MIG-")
                for d in devices)
    log.info("no NVML here: %d GPU(s) found through torch in a child process; NVLink unknown, PCIe assumed", n)
    return Gpus(names=tuple(d["name"] for d in devices), mem_bytes=tuple(int(d["total_memory"]) for d in devices),
                cc=(int(devices[0]["major"]), int(devices[0]["minor"])), links=links, nvlinks=None,
                pcie_gb_s=PCIE_UNKNOWN_GB_S, how="torch (no NVML)",
                sms=tuple(int(d["sms"]) or None for d in devices), mig=mig)

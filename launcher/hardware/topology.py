"""Topology files: `topologies/*.yaml` <-> `Topology`, with validation.

A topology file describes one machine or cluster (see `topologies/h100-sxm-8x.yaml`). Every
problem with a file raises `TopologyError` with one line naming the file, the key and the fix,
because the CLI prints that line and nothing else. Only `yaml.safe_load` is used: a topology file
is data and must never construct Python objects.

Never imports plan, backends, jobs, runtime, results or report.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from launcher.errors import TopologyError
from launcher.files import atomic_write_text, read_yaml_capped, shown
from launcher.hardware.types import NETWORK_KINDS, DeviceSpec, Host, Link, Nic, Topology

log = logging.getLogger(__name__)

# The shipped files live next to the package, so `--topology h100-sxm-8x` works from any cwd.
TOPOLOGIES_DIR = Path(__file__).resolve().parents[2] / "topologies"

_TOP_REQUIRED = ("name", "device", "num_nodes", "devices_per_node", "accelerator", "intra_node")
_TOP_OPTIONAL = ("cpu_cores_per_node", "inter_node", "nics", "host", "source")
_HOST_REQUIRED = ("mem_gib", "link_gb_s", "mem_bw_gb_s")
_ACC_REQUIRED = ("name", "mem_gib", "peak_tflops")
_ACC_OPTIONAL = ("compute_capability", "source")
_LINK_REQUIRED = ("kind", "bw_gb_s", "latency_us")
_LINK_OPTIONAL = ("source",)
_NIC_REQUIRED = ("name", "kind", "speed_gbit_s")
_DTYPES = ("fp32", "tf32", "bf16", "fp16")
_INTRA_KINDS = {"cuda": ("nvswitch", "nvlink", "pcie", "pcie-nop2p"), "cpu": ("shm",)}
# Upper bounds far above any real machine: past them a number is a typo or a hostile file, and
# planning with it would overflow or loop over absurd counts
MAX_NODES = 100_000
MAX_DEVICES_PER_NODE = 4096
MAX_CPU_CORES = 1_000_000
MAX_MEM_GIB = 1e6
MAX_TFLOPS = 1e7
MAX_BW_GB_S = 1e6  # also Gbit/s for NICs
MAX_LATENCY_US = 1e7
# YAML 1.1 reads `1e30` (no dot) as a string; it is meant as a number, so range-check it as one
_NUMERIC_TEXT = re.compile(r"[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?|[-+]?\.(inf|nan)", re.IGNORECASE)


def list_shipped() -> list[str]:
    """Names of the topology files shipped in `topologies/` (without `.yaml`), sorted."""
    return sorted(p.stem for p in TOPOLOGIES_DIR.glob("*.yaml")) if TOPOLOGIES_DIR.is_dir() else []


def resolve_topology_path(path_or_name: str) -> Path:
    """Map `h100-sxm-8x` to the shipped file, or return the given path; raise if it is missing."""
    given = Path(path_or_name).expanduser()
    candidates = [given]
    # A bare name (no directory part) may also mean a shipped file, with or without `.yaml`.
    # `topologies/x.yaml` (as the docs write it) also means a shipped file from any cwd.
    if len(given.parts) == 1 or given.parent == Path("topologies"):
        stem = given.name[:-5] if given.name.endswith(".yaml") else given.name
        candidates.append(TOPOLOGIES_DIR / f"{stem}.yaml")
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    shipped = ", ".join(list_shipped()) or "none"
    raise TopologyError(f"topology {path_or_name!r} not found (looked for {', '.join(map(str, candidates))}); give a "
                        f"path to a YAML file or a shipped name (`ls topologies/` lists them: {shipped})")


def load_topology(path_or_name: str) -> Topology:
    """Load and validate a topology file given by path or by shipped name (`h100-sxm-8x`)."""
    path = resolve_topology_path(str(path_or_name))
    return topology_from_dict(read_yaml_capped(path, error=TopologyError), origin=str(path))


def topology_from_dict(data: Any, *, origin: str = "<topology>") -> Topology:
    """Validate a parsed topology mapping and build the `Topology`; errors name `origin`."""
    try:
        return _build(data)
    except TopologyError as exc:
        raise TopologyError(f"{origin}: {exc}") from exc


def topology_to_dict(t: Topology) -> dict[str, Any]:
    """The YAML schema mapping of `t` (what `save_topology` writes; `device_links` left out)."""
    acc = t.accelerator
    cc = {} if acc.compute_capability is None else {"compute_capability": list(acc.compute_capability)}
    accelerator = {"name": acc.name, "mem_gib": acc.mem_gib, **cc, "peak_tflops": dict(acc.peak_tflops),
                   **({"source": acc.source} if acc.source else {})}
    out: dict[str, Any] = {"name": t.name, "device": t.device, "num_nodes": t.num_nodes,
                           "devices_per_node": t.devices_per_node, "cpu_cores_per_node": t.cpu_cores_per_node,
                           "accelerator": accelerator, "intra_node": _link_to_dict(t.intra_node)}
    if t.inter_node is not None:
        out["inter_node"] = _link_to_dict(t.inter_node)
    if t.nics:
        out["nics"] = [{"name": n.name, "kind": n.kind, "speed_gbit_s": n.speed_gbit_s} for n in t.nics]
    if t.host is not None:
        out["host"] = {"mem_gib": t.host.mem_gib, "link_gb_s": t.host.link_gb_s, "mem_bw_gb_s": t.host.mem_bw_gb_s,
                       **({"source": t.host.source} if t.host.source else {})}
    if t.source:
        out["source"] = t.source
    return out


def save_topology(t: Topology, path: str | Path) -> Path:
    """Write `t` as a topology YAML file that `load_topology` reads back unchanged."""
    target = Path(path)
    text = yaml.safe_dump(topology_to_dict(t), sort_keys=False, allow_unicode=True, width=100)
    atomic_write_text(target, text)  # a reader never sees half a topology
    log.debug("wrote topology %s to %s", t.name, target)
    return target


# -- validation ------------------------------------------------------------------------------

def _link_to_dict(link: Link) -> dict[str, Any]:
    return {"kind": link.kind, "bw_gb_s": link.bw_gb_s, "latency_us": link.latency_us,
            **({"source": link.source} if link.source else {})}


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise TopologyError(f"{where} must be a mapping (key: value lines), got {type(value).__name__}")
    return value


def _check_keys(data: Mapping[str, Any], where: str, required: tuple[str, ...], optional: tuple[str, ...]) -> None:
    allowed = required + optional
    for key in data:
        if key not in allowed:
            raise TopologyError(f"unknown key {shown(key)} in {where}; allowed: {', '.join(allowed)}")
    for key in required:
        if data.get(key) is None:
            raise TopologyError(f"missing required field {key!r} in {where}")


def _number(value: Any, where: str, what: str) -> int | float:
    """An int or float from YAML, or numeric text YAML 1.1 left a string (`1e30`)."""
    if isinstance(value, str) and _NUMERIC_TEXT.fullmatch(value.strip()):
        return float(value)
    # bool is an int subclass; `num_nodes: yes` is a typo, not 1
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TopologyError(f"{where} must be {what}, got {shown(value)}")
    return value


def _in_range(value: int | float, where: str, low: float, high: float, *, low_ok: bool) -> None:
    # NaN compares false with everything: test what is allowed, not what is not
    if not (math.isfinite(value) and value <= high):
        raise TopologyError(f"{where} is out of range: must be a finite number <= {high:g}, got {shown(value)}")
    if not (value >= low if low_ok else value > low):
        raise TopologyError(f"{where} must be {'>=' if low_ok else '>'} {low:g}, got {shown(value)}")


def _int(value: Any, where: str, *, minimum: int = 1, maximum: int) -> int:
    number = _number(value, where, "an integer")
    _in_range(number, where, minimum, maximum, low_ok=True)
    if not isinstance(number, int):
        raise TopologyError(f"{where} must be an integer, got {shown(value)}")
    return number


def _positive(value: Any, where: str, *, maximum: float, allow_zero: bool = False) -> float:
    number = _number(value, where, "a number")
    _in_range(number, where, 0, maximum, low_ok=allow_zero)
    return float(number)


def _str(value: Any, where: str, *, empty_ok: bool = False) -> str:
    if not isinstance(value, str) or (not empty_ok and not value.strip()):
        raise TopologyError(f"{where} must be a non-empty string, got {shown(value)}")
    return value


def _choice(value: Any, where: str, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise TopologyError(f"{where} must be one of {', '.join(choices)}, got {shown(value)}")
    return value


def _accelerator(data: Any, device: str) -> DeviceSpec:
    acc = _mapping(data, "accelerator")
    _check_keys(acc, "accelerator", _ACC_REQUIRED, _ACC_OPTIONAL)
    peaks_in = _mapping(acc["peak_tflops"], "accelerator.peak_tflops")
    peaks: dict[str, float] = {}
    for dtype, value in peaks_in.items():
        if dtype not in _DTYPES:
            raise TopologyError(f"unknown dtype {shown(dtype)} in accelerator.peak_tflops; "
                                f"allowed: {', '.join(_DTYPES)}")
        peaks[dtype] = _positive(value, f"accelerator.peak_tflops.{dtype}", maximum=MAX_TFLOPS)
    if "fp32" not in peaks:
        raise TopologyError("missing required field 'fp32' in accelerator.peak_tflops")
    cc_raw = acc.get("compute_capability")
    cc: tuple[int, int] | None = None
    if cc_raw is not None:
        if device == "cpu":
            raise TopologyError("accelerator.compute_capability is for cuda devices; "
                                "remove it (or set it to null) for device: cpu")
        if (not isinstance(cc_raw, (list, tuple)) or len(cc_raw) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in cc_raw)):
            raise TopologyError("accelerator.compute_capability must be [major, minor], "
                                f"e.g. [8, 0]; got {shown(cc_raw)}")
        cc = (int(cc_raw[0]), int(cc_raw[1]))
    elif device == "cuda":
        # the planner picks bf16 vs fp16 from it; guessing would pick wrong on V100/T4
        raise TopologyError("missing required field 'compute_capability' in accelerator "
                            "(required for device: cuda, e.g. [9, 0])")
    return DeviceSpec(name=_str(acc["name"], "accelerator.name"),
                      mem_gib=_positive(acc["mem_gib"], "accelerator.mem_gib", maximum=MAX_MEM_GIB),
                      peak_tflops=peaks, compute_capability=cc,
                      source=_str(acc.get("source") or "", "accelerator.source", empty_ok=True))


def _link(data: Any, where: str, kinds: tuple[str, ...]) -> Link:
    link = _mapping(data, where)
    _check_keys(link, where, _LINK_REQUIRED, _LINK_OPTIONAL)
    return Link(kind=_choice(link["kind"], f"{where}.kind", kinds),
                bw_gb_s=_positive(link["bw_gb_s"], f"{where}.bw_gb_s", maximum=MAX_BW_GB_S),
                latency_us=_positive(link["latency_us"], f"{where}.latency_us", maximum=MAX_LATENCY_US,
                                     allow_zero=True),
                source=_str(link.get("source") or "", f"{where}.source", empty_ok=True))


def _nics(data: Any) -> tuple[Nic, ...]:
    if data is None:
        return ()
    if not isinstance(data, list):
        raise TopologyError(f"nics must be a list of {{name, kind, speed_gbit_s}}, got {shown(data)}")
    out = []
    for i, item in enumerate(data):
        where = f"nics[{i}]"
        nic = _mapping(item, where)
        _check_keys(nic, where, _NIC_REQUIRED, ())
        out.append(Nic(name=_str(nic["name"], f"{where}.name"),
                       kind=_choice(nic["kind"], f"{where}.kind", NETWORK_KINDS),
                       speed_gbit_s=_positive(nic["speed_gbit_s"], f"{where}.speed_gbit_s", maximum=MAX_BW_GB_S)))
    return tuple(out)


def _host(data: Any) -> Host | None:
    if data is None:
        return None
    host = _mapping(data, "host")
    _check_keys(host, "host", _HOST_REQUIRED, ("source",))
    return Host(mem_gib=_positive(host["mem_gib"], "host.mem_gib", maximum=MAX_MEM_GIB),
                link_gb_s=_positive(host["link_gb_s"], "host.link_gb_s", maximum=MAX_BW_GB_S),
                mem_bw_gb_s=_positive(host["mem_bw_gb_s"], "host.mem_bw_gb_s", maximum=MAX_BW_GB_S),
                source=_str(host.get("source") or "", "host.source", empty_ok=True))


def _build(data: Any) -> Topology:
    if data is None:
        raise TopologyError("file is empty; see topologies/h100-sxm-8x.yaml for the schema")
    top = _mapping(data, "the top level")
    _check_keys(top, "the top level", _TOP_REQUIRED, _TOP_OPTIONAL)
    device = _choice(top["device"], "device", tuple(_INTRA_KINDS))
    num_nodes = _int(top["num_nodes"], "num_nodes", maximum=MAX_NODES)
    inter = top.get("inter_node")
    if num_nodes > 1 and inter is None:
        raise TopologyError(f"missing required field 'inter_node': num_nodes is {num_nodes}, "
                            "so the link between nodes must be described")
    cores = top.get("cpu_cores_per_node")
    return Topology(
        name=_str(top["name"], "name"), device=device, num_nodes=num_nodes,
        devices_per_node=_int(top["devices_per_node"], "devices_per_node", maximum=MAX_DEVICES_PER_NODE),
        cpu_cores_per_node=_int(1 if cores is None else cores, "cpu_cores_per_node", maximum=MAX_CPU_CORES),
        accelerator=_accelerator(top["accelerator"], device),
        intra_node=_link(top["intra_node"], "intra_node", _INTRA_KINDS[device]),
        inter_node=None if inter is None else _link(inter, "inter_node", NETWORK_KINDS), nics=_nics(top.get("nics")),
        host=_host(top.get("host")), source=_str(top.get("source") or "", "source", empty_ok=True))

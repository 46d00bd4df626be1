"""Topology files: `topologies/*.yaml` <-> `Topology`, with validation.

A topology file describes one machine or cluster (see `topologies/h100-sxm-8x.yaml`). Every
problem with a file raises `TopologyError` with one line naming the file, the key and the fix,
because the CLI prints that line and nothing else. Only `yaml.safe_load` is used: a topology file
is data and must never construct Python objects.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from launcher.errors import TopologyError
from launcher.specs import DeviceSpec, Link, Nic, Topology

log = logging.getLogger(__name__)

# The shipped files live next to the package, so `--topology h100-sxm-8x` works from any cwd.
TOPOLOGIES_DIR = Path(__file__).resolve().parents[2] / "topologies"

_TOP_REQUIRED = ("name", "device", "num_nodes", "devices_per_node", "accelerator", "intra_node")
_TOP_OPTIONAL = ("cpu_cores_per_node", "inter_node", "nics", "source")
_ACC_REQUIRED = ("name", "mem_gib", "peak_tflops")
_ACC_OPTIONAL = ("compute_capability", "source")
_LINK_REQUIRED = ("kind", "bw_gb_s", "latency_us")
_LINK_OPTIONAL = ("source",)
_NIC_REQUIRED = ("name", "kind", "speed_gbit_s")
_DTYPES = ("fp32", "tf32", "bf16", "fp16")
_INTRA_KINDS = {"cuda": ("nvswitch", "nvlink", "pcie", "pcie-nop2p"), "cpu": ("shm",)}
NETWORK_KINDS = ("infiniband", "roce", "ethernet")


def list_shipped() -> list[str]:
    """Names of the topology files shipped in `topologies/` (without `.yaml`), sorted."""
    if not TOPOLOGIES_DIR.is_dir():
        return []
    return sorted(p.stem for p in TOPOLOGIES_DIR.glob("*.yaml"))


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
    raise TopologyError(
        f"topology {path_or_name!r} not found (looked for {', '.join(map(str, candidates))}); "
        f"give a path to a YAML file or a shipped name (`ls topologies/` lists them: {shipped})")


def load_topology(path_or_name: str) -> Topology:
    """Load and validate a topology file given by path or by shipped name (`h100-sxm-8x`)."""
    path = resolve_topology_path(str(path_or_name))
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TopologyError(f"{path}: cannot read topology file: {exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise TopologyError(f"{path}: malformed YAML{_yaml_where(exc)}") from exc
    return topology_from_dict(data, origin=str(path))


def topology_from_dict(data: Any, *, origin: str = "<topology>") -> Topology:
    """Validate a parsed topology mapping and build the `Topology`; errors name `origin`."""
    try:
        return _build(data)
    except TopologyError as exc:
        raise TopologyError(f"{origin}: {exc}") from exc


def topology_to_dict(t: Topology) -> dict[str, Any]:
    """The YAML schema mapping of `t` (what `save_topology` writes; `device_links` left out)."""
    acc = t.accelerator
    accelerator: dict[str, Any] = {"name": acc.name, "mem_gib": acc.mem_gib}
    if acc.compute_capability is not None:
        accelerator["compute_capability"] = list(acc.compute_capability)
    accelerator["peak_tflops"] = dict(acc.peak_tflops)
    if acc.source:
        accelerator["source"] = acc.source
    out: dict[str, Any] = {
        "name": t.name,
        "device": t.device,
        "num_nodes": t.num_nodes,
        "devices_per_node": t.devices_per_node,
        "cpu_cores_per_node": t.cpu_cores_per_node,
        "accelerator": accelerator,
        "intra_node": _link_to_dict(t.intra_node),
    }
    if t.inter_node is not None:
        out["inter_node"] = _link_to_dict(t.inter_node)
    if t.nics:
        out["nics"] = [{"name": n.name, "kind": n.kind, "speed_gbit_s": n.speed_gbit_s}
                       for n in t.nics]
    if t.source:
        out["source"] = t.source
    return out


def save_topology(t: Topology, path: str | Path) -> Path:
    """Write `t` as a topology YAML file that `load_topology` reads back unchanged."""
    target = Path(path)
    text = yaml.safe_dump(topology_to_dict(t), sort_keys=False, allow_unicode=True, width=100)
    from launcher.files import atomic_write_text

    atomic_write_text(target, text)  # a reader never sees half a topology
    log.debug("wrote topology %s to %s", t.name, target)
    return target


# -- validation ------------------------------------------------------------------------------

def _yaml_where(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    if mark is None:
        return f": {problem}"
    return f" at line {mark.line + 1}, column {mark.column + 1}: {problem}"


def _link_to_dict(link: Link) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": link.kind, "bw_gb_s": link.bw_gb_s,
                           "latency_us": link.latency_us}
    if link.source:
        out["source"] = link.source
    return out


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise TopologyError(f"{where} must be a mapping (key: value lines), "
                            f"got {type(value).__name__}")
    return value


def _check_keys(data: Mapping[str, Any], where: str, required: tuple[str, ...],
                optional: tuple[str, ...]) -> None:
    allowed = required + optional
    for key in data:
        if key not in allowed:
            raise TopologyError(f"unknown key {key!r} in {where}; allowed: {', '.join(allowed)}")
    for key in required:
        if data.get(key) is None:
            raise TopologyError(f"missing required field {key!r} in {where}")


def _int(value: Any, where: str, minimum: int = 1) -> int:
    # bool is an int subclass; `num_nodes: yes` is a typo, not 1
    if isinstance(value, bool) or not isinstance(value, int):
        raise TopologyError(f"{where} must be an integer, got {value!r}")
    if value < minimum:
        raise TopologyError(f"{where} must be >= {minimum}, got {value}")
    return value


def _positive(value: Any, where: str, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TopologyError(f"{where} must be a number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise TopologyError(f"{where} must be {bound}, got {value}")
    return float(value)


def _str(value: Any, where: str, *, empty_ok: bool = False) -> str:
    if not isinstance(value, str) or (not empty_ok and not value.strip()):
        raise TopologyError(f"{where} must be a non-empty string, got {value!r}")
    return value


def _choice(value: Any, where: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise TopologyError(f"{where} must be one of {', '.join(choices)}, got {value!r}")
    return str(value)


def _accelerator(data: Any, device: str) -> DeviceSpec:
    acc = _mapping(data, "accelerator")
    _check_keys(acc, "accelerator", _ACC_REQUIRED, _ACC_OPTIONAL)
    peaks_in = _mapping(acc["peak_tflops"], "accelerator.peak_tflops")
    peaks: dict[str, float] = {}
    for dtype, value in peaks_in.items():
        if dtype not in _DTYPES:
            raise TopologyError(f"unknown dtype {dtype!r} in accelerator.peak_tflops; "
                                f"allowed: {', '.join(_DTYPES)}")
        peaks[dtype] = _positive(value, f"accelerator.peak_tflops.{dtype}")
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
                                f"e.g. [8, 0]; got {cc_raw!r}")
        cc = (int(cc_raw[0]), int(cc_raw[1]))
    elif device == "cuda":
        # the planner picks bf16 vs fp16 from it; guessing would pick wrong on V100/T4
        raise TopologyError("missing required field 'compute_capability' in accelerator "
                            "(required for device: cuda, e.g. [9, 0])")
    return DeviceSpec(name=_str(acc["name"], "accelerator.name"),
                      mem_gib=_positive(acc["mem_gib"], "accelerator.mem_gib"),
                      peak_tflops=peaks, compute_capability=cc,
                      source=_str(acc.get("source") or "", "accelerator.source", empty_ok=True))


def _link(data: Any, where: str, kinds: tuple[str, ...]) -> Link:
    link = _mapping(data, where)
    _check_keys(link, where, _LINK_REQUIRED, _LINK_OPTIONAL)
    return Link(kind=_choice(link["kind"], f"{where}.kind", kinds),
                bw_gb_s=_positive(link["bw_gb_s"], f"{where}.bw_gb_s"),
                latency_us=_positive(link["latency_us"], f"{where}.latency_us", allow_zero=True),
                source=_str(link.get("source") or "", f"{where}.source", empty_ok=True))


def _nics(data: Any) -> tuple[Nic, ...]:
    if data is None:
        return ()
    if not isinstance(data, list):
        raise TopologyError(f"nics must be a list of {{name, kind, speed_gbit_s}}, got {data!r}")
    out = []
    for i, item in enumerate(data):
        where = f"nics[{i}]"
        nic = _mapping(item, where)
        _check_keys(nic, where, _NIC_REQUIRED, ())
        out.append(Nic(name=_str(nic["name"], f"{where}.name"),
                       kind=_choice(nic["kind"], f"{where}.kind", NETWORK_KINDS),
                       speed_gbit_s=_positive(nic["speed_gbit_s"], f"{where}.speed_gbit_s")))
    return tuple(out)


def _build(data: Any) -> Topology:
    if data is None:
        raise TopologyError("file is empty; see topologies/h100-sxm-8x.yaml for the schema")
    top = _mapping(data, "the top level")
    _check_keys(top, "the top level", _TOP_REQUIRED, _TOP_OPTIONAL)
    device = _choice(top["device"], "device", tuple(_INTRA_KINDS))
    num_nodes = _int(top["num_nodes"], "num_nodes")
    inter = top.get("inter_node")
    if num_nodes > 1 and inter is None:
        raise TopologyError(f"missing required field 'inter_node': num_nodes is {num_nodes}, "
                            "so the link between nodes must be described")
    return Topology(
        name=_str(top["name"], "name"),
        device=device,
        num_nodes=num_nodes,
        devices_per_node=_int(top["devices_per_node"], "devices_per_node"),
        cpu_cores_per_node=_int(1 if top.get("cpu_cores_per_node") is None
                                 else top["cpu_cores_per_node"], "cpu_cores_per_node"),
        accelerator=_accelerator(top["accelerator"], device),
        intra_node=_link(top["intra_node"], "intra_node", _INTRA_KINDS[device]),
        inter_node=None if inter is None else _link(inter, "inter_node", NETWORK_KINDS),
        nics=_nics(top.get("nics")),
        source=_str(top.get("source") or "", "source", empty_ok=True),
    )

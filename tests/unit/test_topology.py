"""Topology files: every shipped file loads; bad files fail with one clear TopologyError line."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from launcher.errors import TopologyError
from launcher.hardware.topology import (
    TOPOLOGIES_DIR,
    list_shipped,
    load_topology,
    resolve_topology_path,
    save_topology,
    topology_from_dict,
    topology_to_dict,
)

# Other modules and the planning benchmark name these files: they must exist under these names.
EXPECTED = {
    "h100-sxm-8x", "a100-sxm-8x", "a100-pcie-8x", "l40s-pcie-8x", "rtx4090-4x", "v100-sxm-8x",
    "t4-4x", "h100-sxm-8x4node-ib", "a100-sxm-8x2node-roce", "h100-sxm-8x128node-ib", "h100-sxm-8x64node-efa",
    "cpu-local",
}

GOOD = """\
name: tiny
device: cuda
num_nodes: 1
devices_per_node: 2
cpu_cores_per_node: 8
accelerator:
  name: Test GPU
  mem_gib: 16
  compute_capability: [8, 0]
  peak_tflops: {fp32: 10, bf16: 100}
  source: test
intra_node: {kind: pcie, bw_gb_s: 20, latency_us: 6, source: test}
source: test
"""


def write(tmp_path: Path, text: str, name: str = "t.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def error_of(tmp_path: Path, text: str) -> str:
    with pytest.raises(TopologyError) as info:
        load_topology(write(tmp_path, text))
    message = str(info.value)
    assert "\n" not in message, "errors must be one line"
    return message


def test_shipped_names_are_all_there():
    assert set(list_shipped()) >= EXPECTED


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_shipped_file_loads_with_sources(name):
    t = load_topology(name)
    assert t.name == name
    # every number must say where it came from
    assert t.accelerator.source and t.intra_node.source and t.source
    if t.inter_node is not None:
        assert t.inter_node.source
    assert t.device == "cpu" or t.accelerator.compute_capability is not None
    # the file is data: its dict round-trips through the schema unchanged
    assert topology_from_dict(topology_to_dict(t)) == t


def test_facts_the_planner_relies_on():
    assert not load_topology("v100-sxm-8x").accelerator.supports_bf16  # must pick fp16
    assert not load_topology("t4-4x").accelerator.supports_bf16
    assert load_topology("h100-sxm-8x").accelerator.peak_tflops["bf16"] == 989
    assert load_topology("rtx4090-4x").intra_node.kind == "pcie-nop2p"
    assert load_topology("l40s-pcie-8x").intra_node.kind == "pcie"
    assert load_topology("h100-sxm-8x128node-ib").world_size == 1024
    ib = load_topology("h100-sxm-8x4node-ib")
    roce = load_topology("a100-sxm-8x2node-roce")
    assert ib.world_size == 32 and len(ib.nics) == 8 and ib.inter_node.kind == "infiniband"
    assert roce.inter_node.kind == "roce" and roce.inter_node.bw_gb_s < roce.intra_node.bw_gb_s
    cpu = load_topology("cpu-local")
    assert cpu.device == "cpu" and cpu.intra_node.kind == "shm" and cpu.devices_per_node == 4
    assert cpu.accelerator.supports_bf16 and cpu.accelerator.compute_capability is None


def test_name_path_and_extension_resolve_to_the_same_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # shipped names must work from any directory
    by_name = resolve_topology_path("h100-sxm-8x")
    assert by_name == TOPOLOGIES_DIR / "h100-sxm-8x.yaml"
    assert resolve_topology_path("h100-sxm-8x.yaml") == by_name
    assert resolve_topology_path(str(by_name)) == by_name
    assert resolve_topology_path("topologies/h100-sxm-8x.yaml") == by_name


def test_save_then_load_round_trips(tmp_path):
    t = load_topology("a100-sxm-8x2node-roce")
    path = save_topology(t, tmp_path / "copy.yaml")
    assert load_topology(str(path)) == t


def test_missing_file_names_path_and_shipped_list(tmp_path):
    with pytest.raises(TopologyError) as info:
        load_topology(str(tmp_path / "nope.yaml"))
    message = str(info.value)
    assert "nope.yaml" in message and "ls topologies/" in message and "h100-sxm-8x" in message
    with pytest.raises(TopologyError, match="ls topologies/"):
        load_topology("h100-typo")


def test_malformed_yaml_gives_line_number(tmp_path):
    message = error_of(tmp_path, "name: x\ndevice: cuda\nnum_nodes: 1 x: 2\ncpu: 3\n")
    assert "malformed YAML at line 3" in message
    message = error_of(tmp_path, "name: x\naccelerator: {name: [oops\n")
    assert "malformed YAML at line" in message and "expected ',' or ']'" in message


def test_unknown_key_names_key_and_allowed_ones(tmp_path):
    message = error_of(tmp_path, GOOD + "gpus_per_node: 8\n")
    assert "'gpus_per_node'" in message and "devices_per_node" in message
    message = error_of(tmp_path, GOOD.replace("source: test\nintra", "sauce: x\nintra"))
    assert "'sauce'" in message and "accelerator" in message and "mem_gib" in message


def test_missing_field(tmp_path):
    message = error_of(tmp_path, GOOD.replace("devices_per_node: 2\n", ""))
    assert "missing required field 'devices_per_node'" in message
    message = error_of(tmp_path, GOOD.replace("  compute_capability: [8, 0]\n", ""))
    assert "compute_capability" in message


def test_negative_bandwidth_and_memory(tmp_path):
    message = error_of(tmp_path, GOOD.replace("bw_gb_s: 20", "bw_gb_s: -5"))
    assert "intra_node.bw_gb_s must be > 0, got -5" in message and "t.yaml" in message
    assert "mem_gib must be > 0" in error_of(tmp_path, GOOD.replace("mem_gib: 16", "mem_gib: 0"))
    assert "peak_tflops.bf16" in error_of(tmp_path, GOOD.replace("bf16: 100", "bf16: -1"))


@pytest.mark.parametrize("old,new,expect", [
    ("num_nodes: 1", "num_nodes: two", "num_nodes must be an integer"),
    ("num_nodes: 1", "num_nodes: true", "num_nodes must be an integer"),
    ("devices_per_node: 2", "devices_per_node: 0", "devices_per_node must be >= 1"),
    ("mem_gib: 16", "mem_gib: lots", "accelerator.mem_gib must be a number"),
    ("[8, 0]", "8.0", "compute_capability must be [major, minor]"),
    ("kind: pcie", "kind: nvlinkk", "intra_node.kind must be one of"),
    ("device: cuda", "device: tpu", "device must be one of"),
    ("fp32: 10, ", "", "'fp32'"),
    ("bf16: 100", "int8: 100", "unknown dtype 'int8'"),
    ("intra_node: {", "intra_node: 5 #", "intra_node must be a mapping"),
])
def test_wrong_types_and_values(tmp_path, old, new, expect):
    assert old in GOOD
    assert expect in error_of(tmp_path, GOOD.replace(old, new, 1))


def test_multi_node_needs_inter_node_and_network_kinds(tmp_path):
    two = GOOD.replace("num_nodes: 1", "num_nodes: 2")
    assert "'inter_node'" in error_of(tmp_path, two)
    bad_kind = two + "inter_node: {kind: nvlink, bw_gb_s: 10, latency_us: 5}\n"
    assert "inter_node.kind must be one of infiniband, roce, efa, ethernet" in error_of(
        tmp_path, bad_kind)
    ok = two + ("inter_node: {kind: roce, bw_gb_s: 9.5, latency_us: 8}\n"
                "nics: [{name: mlx5_0, kind: roce, speed_gbit_s: 100}]\n")
    t = load_topology(write(tmp_path, ok))
    assert t.world_size == 4 and t.nics[0].speed_gbit_s == 100
    assert "nics[0].speed_gbit_s" in error_of(tmp_path, ok.replace("speed_gbit_s: 100",
                                                                   "speed_gbit_s: 0"))


def test_cpu_topology_rules(tmp_path):
    cpu = yaml.safe_load(GOOD)
    cpu["device"] = "cpu"
    cpu["intra_node"]["kind"] = "shm"
    del cpu["accelerator"]["compute_capability"]
    assert load_topology(write(tmp_path, yaml.safe_dump(cpu))).device == "cpu"
    cpu["accelerator"]["compute_capability"] = [8, 0]
    assert "for cuda devices" in error_of(tmp_path, yaml.safe_dump(cpu))
    del cpu["accelerator"]["compute_capability"]
    cpu["intra_node"]["kind"] = "nvlink"
    assert "intra_node.kind must be one of shm" in error_of(tmp_path, yaml.safe_dump(cpu))


def test_empty_and_non_mapping_files(tmp_path):
    assert "empty" in error_of(tmp_path, "")
    assert "mapping" in error_of(tmp_path, "- just\n- a list\n")


def test_the_efa_link_is_the_fit_of_its_clusters_measured_collectives():
    # benchmarks/published/links.py: bandwidth and latency from the playbook's measured
    # all-reduce and all-gather, through dlaunch's collective formulas (a local minimum here;
    # the script searches the whole grid)
    import importlib.util
    import sys

    from tests.helpers import REPO

    spec = importlib.util.spec_from_file_location("published_links", REPO / "benchmarks" / "published" / "links.py")
    assert spec is not None and spec.loader is not None
    links = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = links
    spec.loader.exec_module(links)
    topo = load_topology(links.TOPOLOGY)
    bw, lat = topo.inter_node.bw_gb_s, topo.inter_node.latency_us
    error = links.squared_log_error(topo, bw, lat, ("ar", "ag"))
    for dbw, dlat in ((5, 0), (-5, 0), (0, 0.5), (0, -0.5)):
        assert error < links.squared_log_error(topo, bw + dbw, lat + dlat, ("ar", "ag"))
    # the measurements it rests on: a 256 MB all-gather on 64 nodes took 24 ms, ~50x one node's
    assert 20e-3 < links.measured_s("ag", 64, 8) < 30e-3
    assert links.measured_s("ar", 2, 8) < links.measured_s("ar", 64, 8) / 10

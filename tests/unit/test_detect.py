"""Hardware detection: nvidia-smi parsing on recorded outputs, NVML on a fake, CPU, NICs, SLURM."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from launcher.errors import TopologyError
from launcher.hardware import gpu_probe, nvml_probe
from launcher.hardware.detect import cpu_info, cpu_peak_tflops, detect_nics, detect_topology, slurm_allocation
from launcher.hardware.gpu_probe import count_gpus
from launcher.hardware.nvtopo import (
    inter_node_link,
    intra_node_link,
    parse_nvidia_smi_nvlinks,
    parse_nvidia_smi_p2p,
    parse_nvidia_smi_topo,
)
from launcher.hardware.topology import load_topology
from launcher.hardware.types import LINK_KINDS, Nic, Topology
from launcher.hardware.view import format_topology, inspect_report
from launcher.hardware.visible import visible_gpus

TOPO = Path(__file__).resolve().parents[1] / "data" / "nvidia-smi-topo"
REPO = Path(__file__).resolve().parents[2]


def recorded(name: str) -> str:
    return (TOPO / name).read_text()


def off_diagonal(links):
    return {links[i][j] for i in range(len(links)) for j in range(len(links)) if i != j}


# -- nvidia-smi topo -m ------------------------------------------------------------------------

def test_h100_nvswitch_box():
    text = recorded("h100-sxm-8x-nvswitch.txt")
    links = parse_nvidia_smi_topo(text)
    assert len(links) == 8 and all(len(row) == 8 for row in links)  # NIC columns ignored
    assert off_diagonal(links) == {"nvswitch"}
    assert all(links[i][i] == "" for i in range(8))
    nvlinks = parse_nvidia_smi_nvlinks(text)
    assert nvlinks[0][1] == 18 and nvlinks[3][3] == 0
    link = intra_node_link(links, nvlinks=nvlinks)
    # 80% of 18 x 25 GB/s: within the 370-480 measured on H100 (nccl-tests #212)
    assert link.kind == "nvswitch" and link.bw_gb_s == pytest.approx(360)


def test_pcie_box_with_nvlink_bridges():
    text = recorded("a6000-4x-nvlink-bridge.txt")
    links = parse_nvidia_smi_topo(text)
    assert links[0][1] == links[1][0] == links[2][3] == "nvlink"
    assert links[0][2] == links[1][3] == links[3][0] == "pcie"
    assert off_diagonal(links) <= set(LINK_KINDS)
    nvlinks = parse_nvidia_smi_nvlinks(text)
    # a ring over all 4 must cross PCIe twice, so PCIe is its bottleneck
    assert intra_node_link(links, nvlinks=nvlinks).kind == "pcie"
    # a ring over one bridged pair stays on NVLink (GA102 bridges: 4 x 14.06 GB/s)
    pair = intra_node_link([row[:2] for row in links[:2]], nvlinks=nvlinks, nvlink_gb_s=14.0625)
    assert pair.kind == "nvlink" and pair.bw_gb_s == pytest.approx(45, abs=0.1)


def test_consumer_box_without_p2p():
    text = recorded("rtx4090-4x-nop2p.txt")
    assert off_diagonal(parse_nvidia_smi_topo(text)) == {"pcie"}  # P2P unknown: assume it works
    peer = parse_nvidia_smi_p2p(recorded("rtx4090-4x-nop2p.p2p-r.txt"))
    assert peer[0][0] is None and peer[0][1] is False
    links = parse_nvidia_smi_topo(text, peer_access=peer)
    assert off_diagonal(links) == {"pcie-nop2p"}
    assert parse_nvidia_smi_topo(text, peer_access=False) == links
    link = intra_node_link(links)
    assert link.kind == "pcie-nop2p" and link.bw_gb_s < intra_node_link(
        parse_nvidia_smi_topo(text)).bw_gb_s


def test_parser_copes_with_spaces_and_ansi_and_rejects_garbage():
    text = recorded("a6000-4x-nvlink-bridge.txt")
    spaced = text.replace("\t", "    ")
    underlined = "\x1b[4m" + text.replace("\n", "\x1b[0m\n", 1)
    assert parse_nvidia_smi_topo(spaced) == parse_nvidia_smi_topo(underlined) == \
        parse_nvidia_smi_topo(text)
    with pytest.raises(TopologyError, match="no header row"):
        parse_nvidia_smi_topo("No devices were found\n")
    truncated = "\n".join(text.splitlines()[:3])  # header + 2 of 4 rows
    with pytest.raises(TopologyError, match="4x4"):
        parse_nvidia_smi_topo(truncated)


# real outputs as users posted them (tests/data/nvidia-smi-topo/README.md names each source):
# file -> GPU pairs joined by NVLink (every other pair is PCIe), and the ring's bottleneck
CAPTURED = {
    "h100x8-nvswitch-12nic-numaoff.txt": ("all", "nvswitch"),
    "h100x8-nvswitch-12nic-numaoff.damaged-paste.txt": ("all", "nvswitch"),
    "rtx3090x4-nvlink-bridge-pairs.txt": ({(0, 2), (1, 3)}, "pcie"),
    "a6000x3-one-nvlink-bridge.txt": ({(0, 1)}, "pcie"),
    "rtx5090x2-pcie.txt": (set(), "pcie"),
    "rtx3090x2-pcie-topo-and-p2p.reflowed.txt": (set(), "pcie"),
    "rtx6000adax4-pcie-4nic.txt": (set(), "pcie"),
}


@pytest.mark.parametrize("name", sorted(CAPTURED))
def test_captured_outputs(name):
    nvlinked, bottleneck = CAPTURED[name]
    links = parse_nvidia_smi_topo(recorded(f"captured/{name}"))
    n = len(links)
    for i in range(n):
        for j in range(n):
            if i != j:
                joined = nvlinked == "all" or (min(i, j), max(i, j)) in nvlinked
                assert links[i][j] == ("nvswitch" if nvlinked == "all" else "nvlink" if joined else "pcie"), \
                    (i, j, links[i][j])
    assert intra_node_link(links, nvlinks=parse_nvidia_smi_nvlinks(recorded(f"captured/{name}"))).kind \
        == bottleneck


def test_captured_damaged_paste_reads_like_the_clean_one():
    # the paste lost tabs only in NIC cells and NIC rows: the GPU matrix is intact
    clean = recorded("captured/h100x8-nvswitch-12nic-numaoff.txt")
    damaged = recorded("captured/h100x8-nvswitch-12nic-numaoff.damaged-paste.txt")
    assert "PIXNODE" in damaged and parse_nvidia_smi_nvlinks(damaged) == parse_nvidia_smi_nvlinks(clean)
    assert parse_nvidia_smi_nvlinks(clean)[0][7] == 18


def test_captured_p2p_matrices_mark_pairs_without_peer_access():
    # GNS (GPU not supported) from `-p2p rw` on 2x RTX 5090; NS in a post that pasted both outputs
    gns = parse_nvidia_smi_p2p(recorded("captured/rtx5090x2-pcie.p2p-rw.txt"))
    assert gns == ((None, False), (False, None))
    both = recorded("captured/rtx3090x2-pcie-topo-and-p2p.reflowed.txt")
    p2p_part = both[both.index("NV#  = Connection traversing"):]
    assert parse_nvidia_smi_p2p(p2p_part) == ((None, False), (False, None))
    links = parse_nvidia_smi_topo(recorded("captured/rtx5090x2-pcie.txt"), peer_access=gns)
    assert links[0][1] == links[1][0] == "pcie-nop2p"


def test_two_gpus_on_a_bridge_are_nvlink_not_nvswitch():
    text = "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV4\t0-15\nGPU1\tNV4\t X \t0-15\n"
    assert parse_nvidia_smi_topo(text)[0][1] == "nvlink"


def test_ring_search_uses_an_nvlink_cycle_when_one_exists():
    # DGX-1-like: NVLink around the ring 0-1-2-3-0, PCIe across the diagonals
    nv, pc = "nvlink", "pcie"
    links = [["", nv, pc, nv], [nv, "", nv, pc], [pc, nv, "", nv], [nv, pc, nv, ""]]
    assert intra_node_link(links, nvlinks=[[2] * 4] * 4).kind == "nvlink"
    assert intra_node_link([[""]]).kind == "pcie"  # a single GPU
    with pytest.raises(TopologyError):
        intra_node_link([["", "shm"], ["shm", ""]])


# -- NVML, on a fake pynvml --------------------------------------------------------------------

class _FakeNvmlError(Exception):
    pass


def fake_pynvml(n: int, name: str, *, switch_links: int = 0, p2p: bool = True):
    """A pynvml stand-in: `n` GPUs, each with `switch_links` NVLinks to NVSwitch."""
    m = types.ModuleType("pynvml")
    m.NVMLError = _FakeNvmlError
    m.NVML_FEATURE_ENABLED, m.NVML_NVLINK_MAX_LINKS, m.NVML_NVLINK_DEVICE_TYPE_SWITCH = 1, 18, 2
    bus = [f"00000000:{0x18 + 0x10 * i:02x}:00.0" for i in range(n)]
    m.nvmlInit = m.nvmlShutdown = lambda: None
    m.nvmlDeviceGetCount = lambda: n
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetName = lambda h: name.encode()
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=81559 * 2**20)
    m.nvmlDeviceGetCudaComputeCapability = lambda h: (9, 0)
    m.nvmlDeviceGetMaxPcieLinkGeneration = lambda h: 5
    m.nvmlDeviceGetMaxPcieLinkWidth = lambda h: 16
    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=bus[h].encode())

    def link_state(h, link):
        if link >= switch_links:
            raise _FakeNvmlError("Not Supported")
        return 1

    m.nvmlDeviceGetNvLinkState = link_state
    m.nvmlDeviceGetNvLinkRemotePciInfo = lambda h, link: types.SimpleNamespace(
        busId=b"00000000:c5:00.0")
    m.nvmlDeviceGetNvLinkRemoteDeviceType = lambda h, link: 2
    m.nvmlDeviceGetP2PStatus = lambda a, b, index: 0 if p2p else 5
    return m


def test_nvml_path_on_an_nvswitch_box(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(8, "NVIDIA H100 80GB HBM3",
                                                            switch_links=18))
    assert count_gpus(env={}) == 8
    assert count_gpus(env={"CUDA_VISIBLE_DEVICES": "0,1"}) == 2
    assert count_gpus(env={"CUDA_VISIBLE_DEVICES": ""}) == 0
    t = detect_topology(env={})
    assert t.device == "cuda" and t.devices_per_node == 8 and t.num_nodes == 1
    assert off_diagonal(t.device_links) == {"nvswitch"}
    assert t.intra_node.kind == "nvswitch" and t.intra_node.bw_gb_s == pytest.approx(360)
    assert t.accelerator.compute_capability == (9, 0)
    assert t.accelerator.peak_tflops["bf16"] == 989
    assert t.accelerator.mem_gib == pytest.approx(79.65, abs=0.01)
    # SLURM granted 4 of the 8 and no device cgroup hides the rest: plan for 4
    t4 = detect_topology(env={"SLURM_JOB_ID": "7", "SLURM_GPUS_ON_NODE": "4"})
    assert t4.devices_per_node == 4 and len(t4.device_links) == 4


def test_nvml_path_on_a_consumer_box_without_p2p(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(4, "NVIDIA GeForce RTX 4090",
                                                            p2p=False))
    t = detect_topology(env={})
    assert off_diagonal(t.device_links) == {"pcie-nop2p"}
    assert t.intra_node.kind == "pcie-nop2p"
    assert t.accelerator.peak_tflops["bf16"] == pytest.approx(165.2)
    assert "GPU0" in format_topology(t) and "noP2P" in format_topology(t)


def test_missing_nvml_library_means_no_gpus(monkeypatch):
    m = fake_pynvml(1, "x")

    def no_library():
        raise _FakeNvmlError("NVML Shared Library Not Found")

    m.nvmlInit = no_library
    monkeypatch.setitem(sys.modules, "pynvml", m)
    # a machine without a driver: no nvidia-smi, no /dev/nvidia* (with them, torch is asked)
    monkeypatch.setattr(gpu_probe, "_run", lambda argv: None)
    monkeypatch.setattr(gpu_probe, "_nvidia_device_nodes", lambda dev=None: False)
    assert count_gpus(env={}) == 0


# -- this machine (CPU) ------------------------------------------------------------------------

def test_detect_topology_here_is_valid():
    t = detect_topology(env={})
    assert isinstance(t, Topology) and t.num_nodes == 1 and t.devices_per_node >= 1
    if t.device == "cpu":
        assert t.intra_node.kind == "shm" and t.accelerator.compute_capability is None
        assert t.accelerator.mem_gib > 0 and 0 < t.accelerator.peak_tflops["fp32"] < 10


def test_cpu_topology_forced_and_bf16_follows_cpu_flags():
    t = detect_topology(env={}, device="cpu")
    assert t.device == "cpu" and t.intra_node.kind == "shm" and not t.device_links
    assert t.devices_per_node == t.cpu_cores_per_node == cpu_info().usable_cores
    flags = cpu_info().flags
    assert t.accelerator.supports_bf16 == bool({"avx512_bf16", "amx_bf16"} & flags)


def test_cpu_detection_does_not_import_torch():
    code = ("import sys, launcher.hardware.detect as d, launcher.hardware.gpu_probe as g; "
            "d.detect_topology(); g.count_gpus(); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=60, check=True)
    if count_gpus() == 0:
        assert out.stdout.strip() == "False"


def test_cpu_info_and_peak_estimate():
    text = ("processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: fpu avx avx2 fma avx512f "
            "avx512_bf16\nphysical id\t: 0\n\nprocessor\t: 1\nphysical id\t: 1\n")
    info = cpu_info(text)
    assert info.model == "Test CPU" and info.sockets == 2 and "avx512_bf16" in info.flags
    peaks = cpu_peak_tflops(info.flags, 2.6, 2)
    assert peaks["fp32"] == pytest.approx(0.1664) and peaks["bf16"] == pytest.approx(0.3328)
    assert "bf16" not in cpu_peak_tflops({"avx", "avx2", "fma"}, 3.0, 8)
    assert cpu_peak_tflops({"amx_bf16", "avx512f", "fma"}, 2.0, 1)["bf16"] == pytest.approx(2.048)


# -- NICs ----------------------------------------------------------------------------------------

def make_port(root: Path, dev: str, port: str, rate: str, layer: str, state: str) -> None:
    p = root / dev / "ports" / port
    p.mkdir(parents=True)
    (p / "rate").write_text(rate + "\n")
    (p / "link_layer").write_text(layer + "\n")
    (p / "state").write_text(state + "\n")


def test_nics_from_sysfs_and_psutil(tmp_path):
    make_port(tmp_path, "mlx5_0", "1", "400 Gb/sec (4X NDR)", "InfiniBand", "4: ACTIVE")
    make_port(tmp_path, "mlx5_1", "1", "100 Gb/sec (4X EDR)", "Ethernet", "4: ACTIVE")
    make_port(tmp_path, "mlx5_2", "1", "200 Gb/sec (4X HDR)", "InfiniBand", "1: DOWN")
    (tmp_path / "mlx5_1" / "device" / "net" / "ens1f0").mkdir(parents=True)
    stat = types.SimpleNamespace
    stats = {"lo": stat(isup=True, speed=0), "eth0": stat(isup=True, speed=25000),
             "ens1f0": stat(isup=True, speed=100000), "docker0": stat(isup=True, speed=10000),
             "eth1": stat(isup=False, speed=1000)}
    nics = detect_nics(ib_root=tmp_path, net_stats=stats)
    assert nics == (Nic(name="mlx5_0", kind="infiniband", speed_gbit_s=400.0),
                    Nic(name="mlx5_1", kind="roce", speed_gbit_s=100.0),
                    Nic(name="eth0", kind="ethernet", speed_gbit_s=25.0))
    link = inter_node_link(nics)
    assert link.kind == "infiniband" and link.bw_gb_s == pytest.approx(46.5)  # 48-49 measured
    eight = [Nic(name=f"mlx5_{i}", kind="infiniband", speed_gbit_s=400) for i in range(8)]
    assert inter_node_link(eight).bw_gb_s == pytest.approx(372)  # the shipped 4-node file: 370
    assert inter_node_link([]).kind == "ethernet"
    assert detect_nics(ib_root=tmp_path / "absent", net_stats={}) == ()


def test_efa_ports_are_efa_not_infiniband(tmp_path):
    # EFA's kernel driver reports the link layer "Unknown" (rdma-core#884); an older or other
    # one may say InfiniBand, and Amazon's PCI vendor id tells it apart
    make_port(tmp_path, "rdmap16s27", "1", "100 Gb/sec", "Unknown", "4: ACTIVE")
    make_port(tmp_path, "efa_1", "1", "100 Gb/sec", "InfiniBand", "4: ACTIVE")
    (tmp_path / "efa_1" / "device").mkdir()
    (tmp_path / "efa_1" / "device" / "vendor").write_text("0x1d0f\n")
    nics = detect_nics(ib_root=tmp_path, net_stats={})
    assert [n.kind for n in nics] == ["efa", "efa"]
    # 32 x 100 Gb/s (a p5's): the link the shipped EFA cluster file has, fit to measured collectives
    link = inter_node_link([Nic(name=f"rdmap{i}", kind="efa", speed_gbit_s=100) for i in range(32)])
    shipped = load_topology("h100-sxm-8x64node-efa").inter_node
    assert (link.kind, link.bw_gb_s, link.latency_us) == (shipped.kind, shipped.bw_gb_s, shipped.latency_us)


# -- SLURM ---------------------------------------------------------------------------------------

def test_slurm_env_parsing():
    assert slurm_allocation({}) is None
    assert slurm_allocation({"SLURM_JOB_NUM_NODES": "4"}) is None  # no job id: not in a job
    alloc = slurm_allocation({"SLURM_JOB_ID": "123", "SLURM_JOB_NUM_NODES": "4",
                              "SLURM_GPUS_ON_NODE": "8", "SLURM_JOB_NODELIST": "gpu[01-04]",
                              "SLURM_JOB_PARTITION": "gpu", "SLURM_CPUS_ON_NODE": "112"})
    assert (alloc.job_id, alloc.num_nodes, alloc.gpus_per_node) == ("123", 4, 8)
    assert alloc.nodelist == "gpu[01-04]" and alloc.partition == "gpu"
    assert alloc.cpus_per_node == 112
    older = slurm_allocation({"SLURM_JOB_ID": "1", "SLURM_NNODES": "2",
                              "SLURM_GPUS_PER_NODE": "gpu:a100:4"})
    assert (older.num_nodes, older.gpus_per_node) == (2, 4)
    assert slurm_allocation({"SLURM_JOB_ID": "1", "SLURM_GPUS_PER_NODE": "a100:2,v100:1"}
                            ).gpus_per_node == 3
    assert slurm_allocation({"SLURM_JOB_ID": "1", "SLURM_JOB_GPUS": "0,1,2"}).gpus_per_node == 3
    bare = slurm_allocation({"SLURM_JOB_ID": "9"})
    assert bare.num_nodes == 1 and bare.gpus_per_node is None


def test_slurm_multi_node_cpu_topology():
    env = {"SLURM_JOB_ID": "5", "SLURM_JOB_NUM_NODES": "2"}
    t = detect_topology(env=env, device="cpu")
    assert t.num_nodes == 2 and t.inter_node is not None
    assert t.world_size == 2 * t.devices_per_node
    assert "SLURM      job 5: 2 node(s)" in format_topology(t, env=env)
    assert inspect_report(t, env=env)["slurm"]["num_nodes"] == 2


# -- reports -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["h100-sxm-8x4node-ib", "v100-sxm-8x", "cpu-local"])
def test_reports_for_shipped_topologies(name):
    t = load_topology(name)
    report = inspect_report(t, env={})
    assert json.loads(json.dumps(report))["topology"]["name"] == name
    assert report["backend"] == ("gloo" if t.device == "cpu" else "nccl")
    assert report["slurm"] is None
    text = format_topology(t, env={})
    assert name in text and "Intra-node" in text
    if t.device == "cpu":
        assert "gloo over shared memory" in text
    else:
        assert text.count("\n") > t.devices_per_node  # one table row per GPU
    if name == "v100-sxm-8x":
        assert "not supported (use fp16)" in text


def test_report_includes_the_link_matrix(monkeypatch):
    monkeypatch.setattr(nvml_probe, "probe_nvml", lambda env: None)
    monkeypatch.setattr(gpu_probe, "_probe_nvidia_smi", lambda env: nvml_probe.Gpus(
        names=("NVIDIA RTX A6000",) * 4, mem_bytes=(48 * 2**30,) * 4, cc=(8, 6),
        links=parse_nvidia_smi_topo(recorded("a6000-4x-nvlink-bridge.txt")),
        nvlinks=parse_nvidia_smi_nvlinks(recorded("a6000-4x-nvlink-bridge.txt")),
        pcie_gb_s=31.5, how="nvidia-smi"))
    t = detect_topology(env={})
    assert t.intra_node.kind == "pcie" and t.accelerator.peak_tflops["bf16"] == 154.8
    report = inspect_report(t, env={})
    assert report["device_links"][0][1] == "nvlink"
    assert "NV" in format_topology(t, env={}) and "Links" in format_topology(t, env={})


def test_nvidia_smi_fallback_when_nvml_fails(monkeypatch):
    answers = {
        "--query-gpu=name,memory.total,compute_cap": "NVIDIA GeForce RTX 4090, 24564, 8.9\n" * 4,
        "-m": recorded("rtx4090-4x-nop2p.txt"),
        "r": recorded("rtx4090-4x-nop2p.p2p-r.txt"),
    }
    calls = []

    def fake_run(argv):
        calls.append(argv)
        assert isinstance(argv, list)  # an argv list, never a shell string
        return answers.get(argv[1]) or answers.get(argv[-1])

    monkeypatch.setattr(nvml_probe, "probe_nvml", lambda env: None)
    monkeypatch.setattr(gpu_probe, "_run", fake_run)
    t = detect_topology(env={"CUDA_VISIBLE_DEVICES": "1,2,3"})
    assert t.devices_per_node == 3 and off_diagonal(t.device_links) == {"pcie-nop2p"}
    assert t.accelerator.compute_capability == (8, 9)
    assert t.accelerator.mem_gib == pytest.approx(23.99, abs=0.01)
    assert ["nvidia-smi", "topo", "-p2p", "r"] in calls


def test_cuda_visible_devices():
    assert visible_gpus(4, {}) == [0, 1, 2, 3]
    assert visible_gpus(4, {"CUDA_VISIBLE_DEVICES": "2,0"}) == [2, 0]
    assert visible_gpus(4, {"CUDA_VISIBLE_DEVICES": "0,-1,1"}) == [0]
    assert visible_gpus(4, {"CUDA_VISIBLE_DEVICES": "GPU-aaa,GPU-bbb"}) == [0, 1]
    assert visible_gpus(2, {"CUDA_VISIBLE_DEVICES": "0,5"}) == [0]

"""The CUDA path's hardware view, right by construction (issue 21, findings 6 and 8): MIG slices
planned as slices, GPUs found through torch in a child process where NVML is missing,
CUDA_VISIBLE_DEVICES read as CUDA reads it (and CUDA_DEVICE_ORDER set so it reads it in NVML's
order), and Blackwell / H200 / NVLink 5 figures from the datasheets. All on fake NVML modules,
fake nvidia-smi outputs (real captures) and env dicts."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import types
from pathlib import Path

import pytest

from launcher.hardware import gpu_probe, nvml_probe
from launcher.hardware.detect import detect_topology
from launcher.hardware.gpu_probe import count_gpus, probe_gpus
from launcher.hardware.nvtopo import gpu_spec, nvlink_gb_s
from launcher.hardware.view import format_topology
from launcher.hardware.visible import CudaDevice, cuda_order_env, visible_devices, visible_gpus
from launcher.plan.cost import peak_flops
from launcher.plan.hbm import hbm_bytes_per_s
from launcher.specs import GIB

TOPO = Path(__file__).resolve().parents[1] / "data" / "nvidia-smi-topo"
MIB = 2**20


# -- a fake NVML with MIG ----------------------------------------------------------------------

class FakeNvmlError(Exception):
    pass


def fake_nvml(gpus: list[dict], *, switch_links: int = 0, init_fails: bool = False):
    """A pynvml stand-in. Each GPU: name, mem (MiB), cc, uuid and optionally `mig`: {index:
    slice} where a slice has name (as NVML names it), mem (MiB), sms, slices and uuid; indices
    may be sparse, as NVML's are once instances were destroyed."""
    m = types.ModuleType("pynvml")
    m.NVMLError = FakeNvmlError
    m.NVML_FEATURE_ENABLED, m.NVML_NVLINK_MAX_LINKS, m.NVML_NVLINK_DEVICE_TYPE_SWITCH = 1, 18, 2
    m.NVML_DEVICE_MIG_ENABLE = 1

    def init():
        if init_fails:
            raise FakeNvmlError("NVML Shared Library Not Found")

    m.nvmlInit, m.nvmlShutdown = init, lambda: None
    m.nvmlDeviceGetCount = lambda: len(gpus)
    m.nvmlDeviceGetHandleByIndex = lambda i: ("gpu", i)

    def info(h):
        return gpus[h[1]] if h[0] == "gpu" else gpus[h[1]]["mig"][h[2]]

    m.nvmlDeviceGetName = lambda h: info(h)["name"].encode()
    m.nvmlDeviceGetUUID = lambda h: info(h)["uuid"]
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=info(h)["mem"] * MIB)
    m.nvmlDeviceGetCudaComputeCapability = lambda h: gpus[h[1]]["cc"]
    m.nvmlDeviceGetMaxPcieLinkGeneration = lambda h: 5
    m.nvmlDeviceGetMaxPcieLinkWidth = lambda h: 16
    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(
        busId=f"00000000:{0x18 + 0x10 * h[1]:02x}:00.0".encode())
    m.nvmlDeviceGetMigMode = lambda h: [1, 1] if gpus[h[1]].get("mig") else [0, 0]
    m.nvmlDeviceGetMaxMigDeviceCount = lambda h: 7 if gpus[h[1]].get("mig") else 0

    def mig_handle(h, k):
        if k not in gpus[h[1]].get("mig", {}):
            raise FakeNvmlError("Not Found")
        return ("mig", h[1], k)

    m.nvmlDeviceGetMigDeviceHandleByIndex = mig_handle

    def attributes(h):
        if h[0] != "mig":
            raise FakeNvmlError("Not Supported")  # NVML answers this for MIG handles only
        s = info(h)
        return types.SimpleNamespace(multiprocessorCount=s["sms"], gpuInstanceSliceCount=s["slices"])

    m.nvmlDeviceGetAttributes = attributes

    def link_state(h, link):
        if link >= switch_links:
            raise FakeNvmlError("Not Supported")
        return 1

    m.nvmlDeviceGetNvLinkState = link_state
    m.nvmlDeviceGetNvLinkRemotePciInfo = lambda h, link: types.SimpleNamespace(busId=b"00000000:c5:00.0")
    m.nvmlDeviceGetNvLinkRemoteDeviceType = lambda h, link: 2
    m.nvmlDeviceGetP2PStatus = lambda a, b, index: 0
    return m


def a100(uuid: str, mig: dict | None = None) -> dict:
    return {"name": "NVIDIA A100-SXM4-80GB", "mem": 81920, "cc": (8, 0), "uuid": uuid,
            **({"mig": mig} if mig else {})}


def mig_slice(profile: str, mem: int, sms: int, uuid: str) -> dict:
    return {"name": f"NVIDIA A100-SXM4-80GB MIG {profile}", "mem": mem, "sms": sms,
            "slices": int(profile.split("g")[0]), "uuid": uuid}


# GPU0 in MIG mode with two 1g.10gb slices and a 3g.40gb (index 1 destroyed), GPU1 whole
MIG_HOST = [
    a100("GPU-0a0a0a0a-0000", {0: mig_slice("1g.10gb", 9728, 14, "MIG-aaaa1111"),
                               2: mig_slice("1g.10gb", 9728, 14, "MIG-bbbb2222"),
                               3: mig_slice("3g.40gb", 40192, 42, "MIG-cccc3333")}),
    a100("GPU-1b1b1b1b-1111"),
]


@pytest.fixture
def no_torch_probe(monkeypatch):
    """The torch fallback must not run (nor hit its cache) unless a test asks for it."""
    monkeypatch.setattr(gpu_probe, "_TORCH_CACHE", {})
    monkeypatch.setattr(gpu_probe, "_nvidia_device_nodes", lambda dev=None: False)


# -- 6a: MIG slices ----------------------------------------------------------------------------

def test_mig_slices_are_enumerated_one_entry_each(monkeypatch, no_torch_probe):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(MIG_HOST))
    gpus = probe_gpus({})
    assert gpus is not None and len(gpus.names) == 4  # 3 slices of GPU0, then GPU1
    assert gpus.mig == (True, True, True, False)
    assert gpus.names[0] == "NVIDIA A100-SXM4-80GB MIG 1g.10gb"
    assert gpus.mem_bytes[:3] == (9728 * MIB, 9728 * MIB, 40192 * MIB)  # the slice's, not 80 GB
    assert gpus.sms[:3] == (14, 14, 42)
    # a CUDA process enumerates one MIG device, whatever CUDA_VISIBLE_DEVICES lists
    assert gpus.usable == 1 and count_gpus(env={}) == 1
    assert count_gpus(env={"CUDA_VISIBLE_DEVICES": "0"}) == 1  # GPU0's slices
    assert count_gpus(env={"CUDA_VISIBLE_DEVICES": "1"}) == 1  # GPU1, whole


def test_a_mig_slice_is_planned_with_its_memory_and_share_of_the_sms(monkeypatch, no_torch_probe):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(MIG_HOST))
    t = detect_topology(env={"CUDA_VISIBLE_DEVICES": "MIG-cccc"})  # a unique prefix
    acc = t.accelerator
    assert t.device == "cuda" and t.devices_per_node == 1
    assert acc.name == "NVIDIA A100-SXM4-80GB MIG 3g.40gb"
    assert acc.mem_gib == pytest.approx(39.25, abs=0.01)
    assert acc.peak_tflops["bf16"] == pytest.approx(312 * 42 / 108, abs=0.01)
    assert "MIG slice: 42 of 108 SMs" in acc.source
    assert hbm_bytes_per_s(acc) == pytest.approx(2039e9 * 3 / 7)  # its share of the memory
    # every slice of GPU0 visible: one rank, on the first, and the topology says why
    t_all = detect_topology(env={})
    assert t_all.devices_per_node == 1 and "4 MIG slices visible" in t_all.source
    assert t_all.accelerator.mem_gib == pytest.approx(9.5, abs=0.01)
    assert t_all.accelerator.peak_tflops["bf16"] == pytest.approx(312 * 14 / 108, abs=0.01)
    assert "MIG" in format_topology(t_all, env={})
    # the whole GPU next to it is still a whole GPU
    whole = detect_topology(env={"CUDA_VISIBLE_DEVICES": "1"}).accelerator
    assert whole.peak_tflops["bf16"] == 312 and whole.mem_gib == pytest.approx(80.0)


def test_mig_share_without_sm_counts_comes_from_the_profile():
    # torch's or an older driver's MIG name, without SM counts: compute slices over 7
    spec = gpu_spec(["NVIDIA A100-SXM4-80GB MIG 1c.3g.40gb"], [40 * GIB], cc=(8, 0),
                    how="torch (no NVML)", sms=[None], mig=True)
    assert spec.peak_tflops["bf16"] == pytest.approx(312 / 7, abs=0.01)
    assert "1 of 7 compute slices" in spec.source
    # SMs known, but not the full GPU's (no SM count in the table): the slices again
    gb = gpu_spec(["NVIDIA GB200 MIG 2g.47gb"], [47 * GIB], cc=(10, 0), how="NVML", sms=[38],
                  mig=True)
    assert gb.peak_tflops["bf16"] == pytest.approx(2500 * 2 / 7, abs=0.01)
    # not a slice: the full peaks, whatever the SM count
    assert gpu_spec(["NVIDIA A100-SXM4-80GB"], [80 * GIB], cc=(8, 0), how="NVML",
                    sms=[108]).peak_tflops["bf16"] == 312


def test_a_mig_slice_without_a_profile_in_its_nvml_name_is_still_named_a_slice(monkeypatch, no_torch_probe):
    host = [a100("GPU-0a0a", {0: {**mig_slice("2g.20gb", 19968, 28, "MIG-dddd"),
                                   "name": "NVIDIA A100-SXM4-80GB"}})]
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(host))
    acc = detect_topology(env={}).accelerator
    assert acc.name == "NVIDIA A100-SXM4-80GB MIG 2g slice"
    assert acc.peak_tflops["bf16"] == pytest.approx(312 * 28 / 108, abs=0.01)
    assert hbm_bytes_per_s(acc) == pytest.approx(2039e9 * 2 / 7)


# -- 6c: CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER --------------------------------------------

DEVICES = [CudaDevice(gpu=0, gpu_uuid="GPU-11aa", uuid="GPU-11aa"),
           CudaDevice(gpu=1, gpu_uuid="GPU-22bb", uuid="MIG-33cc", mig=True),
           CudaDevice(gpu=1, gpu_uuid="GPU-22bb", uuid="MIG-44dd", mig=True),
           CudaDevice(gpu=2, gpu_uuid="GPU-22ee", uuid="GPU-22ee")]


@pytest.mark.parametrize(("cvd", "expected"), [
    (None, [0, 1, 2, 3]),
    ("2,0", [3, 0]),  # indices name GPUs in NVML (PCI) order
    ("1", [1, 2]),  # a MIG-enabled GPU's index: its slices
    (" 2 , 0 ", [3, 0]),
    ("0,3,1", [0]),  # the list ends at the first index past the last GPU
    ("0,-1,2", [0]),  # ... and at a negative one
    ("0,,2", [0]),  # ... and at an empty one
    ("", []),
    ("0,0", []),  # a device named twice hides every device
    ("0,GPU-11aa", []),
    ("GPU-11", [0]),  # UUIDs, or unique prefixes of them
    ("GPU-22e,GPU-11aa", [3, 0]),
    ("GPU-22bb", [1, 2]),  # a MIG-enabled GPU's UUID: its slices
    ("GPU-22", []),  # ambiguous: ends the list
    ("MIG-44dd", [2]),
    ("MIG-4,GPU-11aa", [2, 0]),
    ("MIG-", []),
    ("MIG-GPU-22bb/1/0", []),  # CUDA 11.0's MIG names: not understood by CUDA 11.1+ either
    ("nvidia0", []),
])
def test_cuda_visible_devices_is_read_as_cuda_reads_it(cvd, expected):
    assert visible_devices(DEVICES, cvd) == expected


def test_gpu_uuids_select_those_gpus_not_the_first_ones(monkeypatch, no_torch_probe):
    host = [{"name": "NVIDIA H100 80GB HBM3", "mem": 81559, "cc": (9, 0), "uuid": "GPU-h100"},
            {"name": "NVIDIA A100-SXM4-80GB", "mem": 81920, "cc": (8, 0), "uuid": "GPU-a100"}]
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(host))
    t = detect_topology(env={"CUDA_VISIBLE_DEVICES": "GPU-a100"})
    assert t.devices_per_node == 1 and t.accelerator.name == "NVIDIA A100-SXM4-80GB"
    assert t.accelerator.peak_tflops["bf16"] == 312
    assert count_gpus(env={"CUDA_VISIBLE_DEVICES": "GPU-nope"}) == 0
    # nvidia-smi without UUIDs to match against keeps the list's length (the old reading)
    assert visible_gpus(3, {"CUDA_VISIBLE_DEVICES": "GPU-x,GPU-y"}) == [0, 1]
    assert visible_gpus(3, {"CUDA_VISIBLE_DEVICES": "GPU-22"},
                              uuids=["GPU-11", "GPU-222", "GPU-333"]) == [1]


def test_ranks_number_devices_in_nvml_order_unless_the_user_chose():
    assert cuda_order_env({}) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert cuda_order_env({"CUDA_VISIBLE_DEVICES": "1,0"}) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert cuda_order_env({"CUDA_DEVICE_ORDER": "FASTEST_FIRST"}) == {}
    assert cuda_order_env({"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}) == {}


def test_a_chosen_fastest_first_order_on_a_mixed_host_is_warned_about(monkeypatch, caplog, no_torch_probe):
    host = [{"name": "NVIDIA GeForce RTX 3090", "mem": 24576, "cc": (8, 6), "uuid": "GPU-a"},
            {"name": "NVIDIA GeForce RTX 4090", "mem": 24564, "cc": (8, 9), "uuid": "GPU-b"}]
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(host))
    with caplog.at_level(logging.WARNING, logger="launcher.hardware.nvml_probe"):
        probe_gpus({"CUDA_DEVICE_ORDER": "FASTEST_FIRST"})
    assert "CUDA_DEVICE_ORDER=FASTEST_FIRST" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="launcher.hardware.nvml_probe"):
        probe_gpus({})  # dlaunch's ranks get PCI_BUS_ID: nothing to warn about
    assert "CUDA_DEVICE_ORDER" not in caplog.text


# -- 6b: no NVML, GPUs through torch in a child process ----------------------------------------

def _torch_answer(devices, peer):
    return json.dumps({"devices": devices, "peer": peer}) + "\n"


@pytest.fixture
def no_nvml(monkeypatch):
    """A container given the compute capability but not NVML: nvmlInit fails, no nvidia-smi."""
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([], init_fails=True))
    monkeypatch.setattr(gpu_probe, "_run", lambda argv: None)
    monkeypatch.setattr(gpu_probe, "_TORCH_CACHE", {})
    monkeypatch.setattr(gpu_probe, "_nvidia_device_nodes", lambda dev=None: True)


def test_without_nvml_the_gpus_come_from_torch_in_a_child_process(monkeypatch, no_nvml):
    h100 = {"name": "NVIDIA H100 80GB HBM3", "total_memory": 85520809984, "major": 9,
            "minor": 0, "sms": 132}
    calls = []

    def fake_run(argv, **kw):
        calls.append((argv, kw))
        return subprocess.CompletedProcess(argv, 0, _torch_answer(
            [h100, h100], [[None, True], [True, None]]), "")

    monkeypatch.setattr(gpu_probe.subprocess, "run", fake_run)
    assert count_gpus(env={"CUDA_VISIBLE_DEVICES": "0,1", "PATH": "/bin"}) == 2
    t = detect_topology(env={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert t.device == "cuda" and t.devices_per_node == 2
    assert t.accelerator.peak_tflops["bf16"] == 989 and t.accelerator.compute_capability == (9, 0)
    assert t.accelerator.mem_gib == pytest.approx(79.65, abs=0.01)
    assert t.intra_node.kind == "pcie" and "torch" in t.source
    argv, kw = calls[0]
    assert argv[:2] == [sys.executable, "-c"] and "torch.cuda.get_device_properties" in argv[2]
    # CUDA in the child applies the caller's CUDA_VISIBLE_DEVICES, in the ranks' order
    assert kw["env"]["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert kw["env"]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert len(calls) == 1  # cached: the host's GPUs do not change while dlaunch runs
    # no child where no GPU can be: every GPU hidden, or no NVIDIA device node
    calls.clear()
    monkeypatch.setattr(gpu_probe, "_TORCH_CACHE", {})
    assert count_gpus(env={"CUDA_VISIBLE_DEVICES": ""}) == 0
    monkeypatch.setattr(gpu_probe, "_nvidia_device_nodes", lambda dev=None: False)
    assert count_gpus(env={}) == 0
    assert not calls
    # a failed child is no GPU, not a crash
    monkeypatch.setattr(gpu_probe, "_nvidia_device_nodes", lambda dev=None: True)
    monkeypatch.setattr(gpu_probe.subprocess, "run", lambda argv, **kw: subprocess.CompletedProcess(
        argv, 1, "", "RuntimeError: CUDA driver initialization failed"))
    assert count_gpus(env={}) == 0


def test_torch_probe_sees_mig_slices_and_peer_access(monkeypatch, no_nvml):
    mig = {"name": "NVIDIA A100-SXM4-80GB MIG 1g.10gb", "total_memory": 9728 * MIB,
           "major": 8, "minor": 0, "sms": 14}
    monkeypatch.setattr(gpu_probe.subprocess, "run", lambda argv, **kw: subprocess.CompletedProcess(
        argv, 0, _torch_answer([mig], [[None]]), ""))
    t = detect_topology(env={"CUDA_VISIBLE_DEVICES": "MIG-aaaa1111"})
    assert t.devices_per_node == 1 and t.accelerator.mem_gib == pytest.approx(9.5)
    assert t.accelerator.peak_tflops["bf16"] == pytest.approx(312 * 14 / 108, abs=0.01)
    rtx = {"name": "NVIDIA GeForce RTX 4090", "total_memory": 24 * GIB, "major": 8, "minor": 9,
           "sms": 128}
    monkeypatch.setattr(gpu_probe, "_TORCH_CACHE", {})
    monkeypatch.setattr(gpu_probe.subprocess, "run", lambda argv, **kw: subprocess.CompletedProcess(
        argv, 0, _torch_answer([rtx, rtx], [[None, False], [False, None]]), ""))
    assert detect_topology(env={}).intra_node.kind == "pcie-nop2p"


def test_peer_access_nvidia_smi_cannot_report_comes_from_the_child(monkeypatch):
    # a driver without `nvidia-smi topo -p2p`: CUDA's answer, asked in a child process (never
    # by initialising CUDA in dlaunch's own), for the visible GPUs only
    answers = {"--query-gpu=name,memory.total,compute_cap": "NVIDIA GeForce RTX 4090, 24564, 8.9\n" * 4,
               "-m": (TOPO / "rtx4090-4x-nop2p.txt").read_text()}
    monkeypatch.setattr(nvml_probe, "probe_nvml", lambda env: None)
    monkeypatch.setattr(gpu_probe, "_run", lambda argv: answers.get(argv[1]) or answers.get(argv[-1]))
    monkeypatch.setattr(gpu_probe, "_TORCH_CACHE", {})
    monkeypatch.setattr(gpu_probe, "_nvidia_device_nodes", lambda dev=None: True)
    rtx = {"name": "NVIDIA GeForce RTX 4090", "total_memory": 24 * GIB, "major": 8, "minor": 9,
           "sms": 128}
    seen = []

    def fake_run(argv, **kw):
        seen.append(kw["env"].get("CUDA_VISIBLE_DEVICES"))
        return subprocess.CompletedProcess(argv, 0, _torch_answer(
            [rtx, rtx], [[None, False], [False, None]]), "")

    monkeypatch.setattr(gpu_probe.subprocess, "run", fake_run)
    t = detect_topology(env={"CUDA_VISIBLE_DEVICES": "2,3"})
    assert t.devices_per_node == 2 and t.device_links[0][1] == "pcie-nop2p"
    assert t.intra_node.kind == "pcie-nop2p" and seen == ["2,3"]


def test_gpu_device_nodes(tmp_path):
    # /dev/nvidia0 ..: not nvidiactl alone, which a host with the driver but no GPU has
    (tmp_path / "nvidiactl").touch()
    assert not gpu_probe._nvidia_device_nodes(tmp_path)
    (tmp_path / "nvidia0").touch()
    assert gpu_probe._nvidia_device_nodes(tmp_path)


def test_the_torch_probe_script_runs_against_the_installed_torch():
    # the real child: on this CPU-only host it finds no device; on a GPU host it lists them
    done = subprocess.run([sys.executable, "-c", gpu_probe._TORCH_PROBE], capture_output=True,
                          text=True, timeout=120, check=True)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(found) == {"devices", "peer"} and len(found["peer"]) == len(found["devices"])
    for d in found["devices"]:
        assert set(d) == {"name", "total_memory", "major", "minor", "sms"} and d["sms"] > 0


# -- 8: Blackwell, H200, NVLink 5 --------------------------------------------------------------

def test_the_captured_rtx_5090_box_gets_blackwell_peaks_not_placeholders(monkeypatch):
    # 2x RTX 5090 (tests/data/nvidia-smi-topo/captured): nvidia-smi's answers on that box
    answers = {
        "--query-gpu=name,memory.total,compute_cap": "NVIDIA GeForce RTX 5090, 32607, 12.0\n" * 2,
        "-m": (TOPO / "captured" / "rtx5090x2-pcie.txt").read_text(),
        "r": (TOPO / "captured" / "rtx5090x2-pcie.p2p-rw.txt").read_text(),
    }
    monkeypatch.setattr(nvml_probe, "probe_nvml", lambda env: None)
    monkeypatch.setattr(gpu_probe, "_run", lambda argv: answers.get(argv[1]) or answers.get(argv[-1]))
    t = detect_topology(env={})
    acc = t.accelerator
    assert t.devices_per_node == 2 and acc.compute_capability == (12, 0)
    # RTX Blackwell whitepaper: BF16 with FP32 accumulate 209.5 dense, FP32 104.8
    assert acc.peak_tflops == {"fp32": 104.8, "tf32": 104.8, "bf16": 209.5, "fp16": 209.5}
    assert "placeholder" not in acc.source
    assert peak_flops(acc, "bf16") == pytest.approx(209.5e12)
    assert hbm_bytes_per_s(acc) == pytest.approx(1792e9)  # GDDR7
    assert t.intra_node.kind == "pcie-nop2p"  # GNS: no P2P between GeForce Blackwell cards
    assert "bf16 209.5" in format_topology(t, env={})
    # the laptop part is a smaller chip: not planned with the desktop card's peaks
    laptop = gpu_spec(["NVIDIA GeForce RTX 5090 Laptop GPU"], [24 * GIB], cc=(12, 0), how="NVML")
    assert "placeholder" in laptop.source


@pytest.mark.parametrize(("name", "cc", "bf16", "fp32", "hbm_gb_s"), [
    ("NVIDIA B200", (10, 0), 2250, 75, 7700),  # HGX B200 spec table
    ("NVIDIA GB200", (10, 0), 2500, 80, 8000),  # GB200 NVL72 spec table, per GPU
    ("NVIDIA H200", (9, 0), 989, 67, 4800),  # H200 datasheet: H100's compute, faster HBM3e
    ("NVIDIA H200 NVL", (9, 0), 835.5, 60, 4800),
    ("NVIDIA H100 NVL", (9, 0), 835.5, 60, 3900),
    ("NVIDIA GH200 480GB", (9, 0), 989, 67, 4000),
])
def test_datasheet_figures(name, cc, bf16, fp32, hbm_gb_s):
    spec = gpu_spec([name], [80 * GIB], cc=cc, how="NVML")
    assert spec.peak_tflops["bf16"] == bf16 and spec.peak_tflops["fp32"] == fp32
    assert "placeholder" not in spec.source
    assert hbm_bytes_per_s(spec) == pytest.approx(hbm_gb_s * 1e9)


def test_an_hgx_b200_box_runs_its_rings_over_nvlink_5(monkeypatch, no_torch_probe):
    host = [{"name": "NVIDIA B200", "mem": 183359, "cc": (10, 0), "uuid": f"GPU-b{i}"}
            for i in range(8)]
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(host, switch_links=18))
    t = detect_topology(env={})
    assert t.devices_per_node == 8 and t.intra_node.kind == "nvswitch"
    # 18 NVLink 5 links x 50 GB/s each way (900 GB/s, 1.8 TB/s both ways) x 80%
    assert t.intra_node.bw_gb_s == pytest.approx(720)
    assert t.accelerator.peak_tflops["bf16"] == 2250
    assert t.accelerator.mem_gib == pytest.approx(179.06, abs=0.01)


def test_nvlink_lane_rates():
    assert nvlink_gb_s((10, 0)) == 50.0  # NVLink 5
    assert nvlink_gb_s((9, 0)) == nvlink_gb_s((8, 0)) == nvlink_gb_s(None) == 25.0
    assert nvlink_gb_s((8, 6)) == 14.0625  # GA10x bridges

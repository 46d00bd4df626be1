"""`dlaunch inspect [--json]` end to end: the real CLI in a subprocess, on this machine's CPUs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import psutil

from launcher.hardware.detect import usable_cores

REPO = Path(__file__).resolve().parents[2]
# An empty CUDA_VISIBLE_DEVICES hides every GPU from NVML and nvidia-smi alike, so these tests
# take the CPU path on GPU hosts too.
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}


def _cgroup_quota_limited() -> bool:
    try:
        quota = Path("/sys/fs/cgroup/cpu.max").read_text().split()
    except OSError:
        return False
    return len(quota) == 2 and quota[0] != "max"


# `dlaunch` is the fixture from tests/conftest.py (not imported by name: another conftest.py
# under tests/ can shadow the module `conftest` when the whole suite is collected).

def test_inspect_json_says_cpu_with_this_hosts_cores(dlaunch):
    done = dlaunch("inspect", "--json", env=CPU_ONLY, timeout=120)
    assert done.code == 0, (done.out, done.err)
    report = json.loads(done.out)  # stdout is the JSON and nothing else
    topo = report["topology"]
    assert topo["device"] == "cpu" and topo["num_nodes"] == 1
    assert report["backend"] == "gloo" and report["device_links"] == []
    assert report["slurm"] is None or "SLURM_JOB_ID" in os.environ
    affinity = len(os.sched_getaffinity(0))
    cores = topo["devices_per_node"]
    assert cores == topo["cpu_cores_per_node"] == report["world_size"]
    assert cores == usable_cores()  # the subprocess sees what this process sees
    # SMT siblings never count twice: one rank per physical core this process may run on,
    # counted here from each allowed CPU's sibling list (a file inspect does not read)
    siblings = {Path(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list").read_text().strip()
                for c in os.sched_getaffinity(0)}
    expected = len(siblings)
    if _cgroup_quota_limited():
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        expected = min(expected, max(1, math.ceil(int(quota) / int(period))))
    assert cores == expected
    smt = (psutil.cpu_count(logical=True) or 1) > (psutil.cpu_count(logical=False) or 1)
    if not smt and not _cgroup_quota_limited():
        assert cores == affinity  # one rank per core this process may run on
    assert topo["intra_node"]["kind"] == "shm"
    assert topo["accelerator"]["mem_gib"] > 0 and topo["accelerator"]["peak_tflops"]["fp32"] > 0


def test_inspect_text_names_gloo_and_shared_memory(dlaunch):
    done = dlaunch("inspect", env=CPU_ONLY, timeout=120)
    assert done.code == 0, (done.out, done.err)
    assert "gloo" in done.out and "shared memory" in done.out
    assert "Intra-node shm" in done.out and "CPU cores" in done.out
    cores = usable_cores()
    assert f"x {cores} cpu device(s) = {cores} ranks" in done.out
    assert "Traceback" not in done.err


def test_inspect_is_listed_and_rejects_extra_arguments(dlaunch):
    helped = dlaunch("--help", timeout=60)
    assert helped.code == 0 and "inspect" in helped.out
    for args, needle in ((("inspect", "--bogus"), "--bogus"), (("inspect", "--", "x"), "`--`")):
        done = dlaunch(*args, env=CPU_ONLY, timeout=60)
        assert done.code == 2 and done.out == "", (done.code, done.out, done.err)
        lines = [line for line in done.err.splitlines() if line.strip()]
        assert len(lines) == 1 and needle in lines[0] and "Traceback" not in done.err, done.err


def test_inspect_does_not_import_torch():
    code = ("import sys; from launcher.cli.main import main; rc = main(['inspect', '--json']); "
            "print('torch' in sys.modules, file=sys.stderr); sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **CPU_ONLY})
    assert done.returncode == 0, done.stderr
    json.loads(done.stdout)
    assert done.stderr.strip().splitlines()[-1] == "False"

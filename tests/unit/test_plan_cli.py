"""`dlaunch plan` end to end: real profiling on the meta device, topology files, bad input."""

import json

import pytest

from tests.helpers import DATA, REPO, assert_one_line_error

GPT = str(REPO / "workloads" / "gpt.py")


def test_plan_this_machine_json(dlaunch):
    done = dlaunch("plan", GPT, "--gpus", "2", "--json")
    assert done.code == 0, done.err
    data = json.loads(done.out)
    chosen = data["plan"]["chosen"]
    assert data["plan"]["world_size"] == 2 and chosen["fits"]
    # which of them wins on two CPU ranks follows the host's measured rates and gloo collectives
    assert chosen["strategy"]["kind"] in ("ddp", "zero1", "fsdp_full", "fsdp_grad_op")
    assert data["profile"]["num_params"] > 4e6


def test_plan_8b_on_h100_picks_fsdp_and_says_why(dlaunch):
    done = dlaunch("plan", GPT, "--topology", "h100-sxm-8x", "--global-batch", "64", "--seq-len", "4096",
                   "--", "--size", "llama3-8b")
    assert done.code == 0, done.err
    assert "FSDP" in done.out.splitlines()[1]
    assert "DDP" in done.out and "usable" in done.out  # the rejected DDP candidate and why
    assert "B/param" in done.out  # the memory assumptions are stated


def test_plan_70b_on_1024_gpus(dlaunch):
    done = dlaunch("plan", GPT, "--topology", "h100-sxm-8x128node-ib", "--global-batch", "1024",
                   "--seq-len", "8192", "--", "--size", "llama3-70b")
    assert done.code == 0, done.err
    assert "1024" in done.out or "1,024" in done.out


@pytest.mark.parametrize("args, needle", [
    (["--topology", "no-such-machine"], "no-such-machine"),
    (["--topology", "h100-sxm-8x", "--gpus", "16"], "--gpus 16 is more than"),
    (["--topology", "h100-sxm-8x", "--nodes", "2"], "no link between nodes"),
    (["--gpus", "0"], "--gpus must be an integer >= 1"),
    (["--global-batch", "x"], "--global-batch must be an integer"),
])
def test_plan_bad_input(dlaunch, args, needle):
    assert_one_line_error(dlaunch("plan", GPT, *args), needle)


def test_plan_malformed_and_negative_topology_files(dlaunch, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ndevice: cuda\n  num_nodes: [1\n")
    assert_one_line_error(dlaunch("plan", GPT, "--topology", str(bad)), "bad.yaml")
    neg = tmp_path / "neg.yaml"
    text = (REPO / "topologies" / "a100-sxm-8x.yaml").read_text()
    neg.write_text(text.replace("bw_gb_s: 230", "bw_gb_s: -230", 1))
    assert "bw_gb_s: -230" in neg.read_text()
    assert_one_line_error(dlaunch("plan", GPT, "--topology", str(neg)), "bw_gb_s")


def test_plan_meta_unsafe_workload_says_how_to_fix(dlaunch):
    done = dlaunch("plan", str(DATA / "meta_unsafe.py"), "--gpus", "1")
    assert_one_line_error(done, "meta", "meta-safe")


def test_plan_into_a_closed_pipe_exits_1_without_a_traceback():
    # `dlaunch plan --json | head -1`: the reader leaves before the JSON is written
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "launcher.cli.main", "plan", "workloads/gpt.py", "--gpus", "2",
                             "--json", "--", "--size", "tiny"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 1 and "Traceback" not in err, err

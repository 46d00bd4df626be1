"""The SLURM backend without a cluster: sbatch script + per-node torchrun commands against golden
files, --slurm-opt validation, dlaunch.yaml defaults and errors, flags that need --slurm."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from launcher.backends.slurm import submit as slurm
from launcher.cli.config import load_config
from launcher.errors import ConfigError, UsageError
from launcher.runspec import LaunchSpec

from tests.helpers import REPO, WORKLOADS, assert_golden, assert_one_line_error

PYTHON = "/PY/bin/python"


def spec(**kw) -> LaunchSpec:
    base = dict(workload="/work/workloads/mlp.py", run_id="mlp-golden", run_dir="/RUN",
                nodes=1, gpus=2, steps=30, micro_batch=8, strategy="ddp")
    return LaunchSpec(**{**base, **kw})


def rendering(s: LaunchSpec, sl: slurm.SlurmSpec) -> str:
    text = slurm.dry_run_text(s, sl, slurm.render(s, sl, python=PYTHON, base_env={}))
    return text.replace(str(REPO), "<repo>").replace(PYTHON, "<python>").replace("/RUN", "<run>")


@pytest.mark.parametrize("name,kw,sl", [
    ("slurm-1x2.txt", dict(nodes=1, gpus=2),
     slurm.SlurmSpec(partition="debug", time_min=30, cpus_per_node=2)),
    ("slurm-2x1.txt", dict(nodes=2, gpus=1),
     slurm.SlurmSpec(partition="debug", cpus_per_node=2)),
    ("slurm-2x2.txt", dict(nodes=2, gpus=2, device="cuda"),
     slurm.SlurmSpec(partition="gpu", time_min=90.5, account="proj", qos="high", constraint="a100",
                     cpus_per_node=32, opts=slurm.parse_slurm_opts(["mem=64G", "exclusive=user"]))),
])
def test_sbatch_script_and_node_commands_match_golden(name, kw, sl, monkeypatch):
    # the allocator variable's name follows the ranks' torch (launcher.alloc_conf): fixed here
    monkeypatch.setattr("launcher.backends.torchrun.installed_torch_version", lambda: "2.13.0")
    assert_golden(name, rendering(spec(**kw), sl))


def test_rendering_is_what_submitit_generates():
    """The printed script is submitit's own, byte for byte (what submit() compares too)."""
    from submitit.slurm.slurm import _make_sbatch_string

    s, sl = spec(nodes=2), slurm.SlurmSpec(partition="debug", cpus_per_node=2)
    r = slurm.render(s, sl, python=PYTHON, base_env={})
    cmd = f"{PYTHON} -u -m submitit.core._submit /RUN/slurm/%j"
    assert r.script == _make_sbatch_string(command=cmd, folder="/RUN/slurm/%j", **r.parameters)
    assert "#SBATCH --ntasks-per-node=1" in r.script and "#SBATCH --nodes=2" in r.script
    assert "--wckey" not in r.script  # refused where wckeys are enforced


def test_node_commands_rendezvous_on_the_first_node_with_a_job_derived_port():
    from launcher.backends.slurm.task import node_argv, rdzv_port

    assert rdzv_port(7) == 20007 and rdzv_port(20007) == 20007 and rdzv_port(123456) == 23456
    argv = node_argv(spec(nodes=2), python="py", head="n1", port=rdzv_port(42), node_rank=1)
    assert argv[argv.index("--rdzv-endpoint") + 1] == "n1:20042"
    assert argv[argv.index("--node-rank") + 1] == "1"
    assert argv[argv.index("--log-dir") + 1] == "/RUN/logs/node-1"


@pytest.mark.parametrize("items,needle", [
    (["mem32G"], "malformed"), (["=5"], "malformed"), (["mem="], "malformed"),
    (["bad key=1"], "malformed"), (["nodes=3"], "use --nodes"), (["output=/x"], "dlaunch sets it"),
    (["comment=a\nrm -rf /"], "control characters"),
])
def test_bad_slurm_opts_are_refused(items, needle):
    with pytest.raises(UsageError, match=needle):
        slurm.parse_slurm_opts(items)


def test_slurm_opts_merge_over_config_and_normalise():
    assert slurm.parse_slurm_opts(["mail_type=END", "--mem=8G"], {"mem": "4G", "gres": "gpu:2"}) == (
        ("gres", "gpu:2"), ("mail-type", "END"), ("mem", "8G"))


def test_config_defaults_and_errors(tmp_path: Path):
    assert load_config(tmp_path).path is None
    (tmp_path / "dlaunch.yaml").write_text(
        "slurm:\n  partition: gpu\n  account: proj\n  time_min: 30\n  opts: {mem: 8G, exclusive: true}\n")
    cfg = load_config(tmp_path)
    assert (cfg.get("slurm.partition"), cfg.get("slurm.account"), cfg.get("slurm.time_min")) == ("gpu", "proj", 30)
    assert dict(cfg.get("slurm.opts")) == {"mem": "8G", "exclusive": "true"}
    for text, needle in [("slurm:\n  partitoin: gpu\n", "unknown key 'slurm.partitoin'"),
                         ("slrum: {}\n", "unknown key 'slrum'"),
                         ("slurm:\n  time_min: yes\n", "slurm.time_min"),
                         ("slurm: [1\n", "not valid YAML"),
                         ("- a\n", "must be a mapping")]:
        (tmp_path / "dlaunch.yaml").write_text(text)
        with pytest.raises(ConfigError, match=needle):
            load_config(tmp_path)


def test_dry_run_uses_dlaunch_yaml_and_flags_win(dlaunch, tmp_path: Path):
    (tmp_path / "dlaunch.yaml").write_text("slurm:\n  partition: fromyaml\n  account: acct\n  time_min: 30\n")
    done = dlaunch("run", str(WORKLOADS / "mlp.py"), "--slurm", "--nodes", "2", "--dry-run",
                   "--cpus-per-node", "2", "--time-min", "45", cwd=tmp_path)
    assert done.code == 0, done.err
    assert "#SBATCH --partition=fromyaml" in done.out and "#SBATCH --account=acct" in done.out
    assert "#SBATCH --time=45" in done.out and "#SBATCH --cpus-per-task=2" in done.out
    assert done.out.count("-m torch.distributed.run") == 2 and "--node-rank 1" in done.out
    assert not (tmp_path / "runs").exists()  # a dry run creates nothing


def test_slurm_run_plans_only_from_the_partitions_topology(dlaunch, tmp_path: Path):
    # no topology: the login node is the wrong machine to plan for, so the fallbacks are named
    done = dlaunch("run", str(WORKLOADS / "mlp.py"), "--slurm", "--nodes", "2", "--dry-run", cwd=tmp_path)
    assert done.code == 0, done.err
    assert "not planned: no --topology" in done.err and "strategy ddp" in done.err, done.err
    # a topology from dlaunch.yaml (the flag would win the same way): the plan for 2 nodes of it
    (tmp_path / "dlaunch.yaml").write_text(f"slurm:\n  topology: {REPO / 'topologies' / 'cpu-local.yaml'}\n")
    done = dlaunch("run", str(WORKLOADS / "mlp.py"), "--slurm", "--nodes", "2", "--dry-run", cwd=tmp_path)
    assert done.code == 0, done.err
    # planned (which strategy wins, DDP or ZeRO-1, rests on this host's measured rates: a near tie)
    assert re.search(r"dlaunch: plan: (DDP|ZeRO-1|FSDP) ", done.err) and "not planned" not in done.err, done.err
    assert not (tmp_path / "runs").exists()


def test_scale_slurm_dry_run_spreads_points_over_nodes(dlaunch, tmp_path: Path):
    done = dlaunch("scale", str(WORKLOADS / "mlp.py"), "--slurm", "--gpus", "1,2,4,8", "--gpus-per-node", "2",
                   "--dry-run", cwd=tmp_path)
    assert done.code == 0, done.err
    assert "(SLURM jobs)" in done.out and "ws1-r0: 1 rank(s) = 1 node(s) x 1," in done.out
    assert "ws4-r0: 4 rank(s) = 2 node(s) x 2," in done.out and "ws8-r0: 8 rank(s) = 4 node(s) x 2," in done.out
    bad = dlaunch("scale", str(WORKLOADS / "mlp.py"), "--slurm", "--gpus", "1,3", "--gpus-per-node", "2",
                  "--dry-run", cwd=tmp_path)
    assert_one_line_error(bad, "world size 3 does not fill whole nodes of 2")
    local = dlaunch("scale", str(WORKLOADS / "mlp.py"), "--gpus", "1", "--gpus-per-node", "2", cwd=tmp_path)
    assert_one_line_error(local, "--gpus-per-node needs --slurm")
    assert not (tmp_path / "runs").exists()


def test_unknown_config_key_is_one_line(dlaunch, tmp_path: Path):
    (tmp_path / "dlaunch.yaml").write_text("slurm:\n  partiton: gpu\n")
    done = dlaunch("run", str(WORKLOADS / "mlp.py"), "--slurm", "--dry-run", cwd=tmp_path)
    assert_one_line_error(done, "dlaunch.yaml", "unknown key 'slurm.partiton'")


def test_malformed_slurm_opt_is_one_line(dlaunch, tmp_path: Path):
    done = dlaunch("run", str(WORKLOADS / "mlp.py"), "--slurm", "--slurm-opt", "mem32G", cwd=tmp_path)
    assert_one_line_error(done, "--slurm-opt 'mem32G' is malformed", "KEY=VALUE")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("flag", [["--nodes", "2"], ["--partition", "x"], ["--detach"],
                                  ["--slurm-opt", "mem=1G"], ["--topology", "topologies/cpu-local.yaml"]])
def test_slurm_flags_need_slurm(dlaunch, flag, tmp_path: Path):
    done = dlaunch("run", str(WORKLOADS / "mlp.py"), *flag, cwd=tmp_path)
    assert_one_line_error(done, f"{flag[0]} needs --slurm")


def test_no_slurm_commands_is_one_line(dlaunch, tmp_path: Path):
    empty = tmp_path / "bin"
    empty.mkdir()
    done = dlaunch("run", str(WORKLOADS / "mlp.py"), "--slurm", cwd=tmp_path, env={"PATH": str(empty)})
    assert_one_line_error(done, "--slurm needs the SLURM client commands", "sbatch")
    assert not (tmp_path / "runs").exists()


def test_status_of_a_dir_that_is_no_slurm_run_is_one_line(dlaunch, tmp_path: Path):
    assert_one_line_error(dlaunch("status", str(tmp_path)), "not a SLURM run")
    assert_one_line_error(dlaunch("logs", "not-a-job"), "neither a run directory nor a SLURM job id")

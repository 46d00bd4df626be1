"""Render before run: the torchrun command for a spec is exactly the golden file."""

from launcher.backends import local
from launcher.runspec import LaunchSpec

from tests.helpers import REPO, assert_golden


def spec(**kw) -> LaunchSpec:
    base = dict(workload="/work/workloads/gpt.py", workload_args=("--size", "tiny"), run_id="gpt-golden",
                run_dir="/RUN", gpus=2, steps=30, micro_batch=8,
                strategy="ddp")
    return LaunchSpec(**{**base, **kw})


def rendering(s: LaunchSpec) -> str:
    r = local.render(s, python="python3", base_env={}, cores=2)
    env = "\n".join(f"{k}={v}" for k, v in sorted(r.env.items()))
    return (" ".join(r.argv) + "\n" + env + "\n").replace(str(REPO), "<repo>")


def test_local_workload_command_matches_golden():
    assert_golden("local-workload-2.txt", rendering(spec()))


def test_local_script_command_matches_golden():
    assert_golden("local-script-4.txt", rendering(spec(workload="/work/train.py", workload_args=("--lr", "0.1"),
                                               is_script=True, gpus=4, steps=20)))


def test_user_thread_setting_wins():
    r = local.render(spec(), python="python3", base_env={"OMP_NUM_THREADS": "7"}, cores=2)
    assert "OMP_NUM_THREADS" not in r.env  # inherited from the user's environment unchanged
    r = local.render(spec(gpus=4), python="python3", base_env={}, cores=16)
    assert r.env["OMP_NUM_THREADS"] == "4"


def test_rendezvous_is_loopback_with_a_port_the_store_picks():
    argv = local.render(spec(), python="python3", base_env={}, cores=2).argv
    assert argv[argv.index("--rdzv-endpoint") + 1] == "127.0.0.1:0"

"""How CUDA ranks start, on CPU (issue 21, 8): the allocator variable under the name the ranks'
torch reads, never beside the user's own; the process group of a one-rank FSDP run started
like a multi-rank one's (timeout, device id) before FSDP builds its mesh."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest

from launcher.alloc_conf import (
    ALLOC_CONF,
    CUDA_ALLOC_CONF,
    EXPANDABLE_SEGMENTS,
    alloc_conf_env,
    alloc_conf_name,
)
from launcher.backends import local
from launcher.backends import torchrun as torchrun_mod
from launcher.hardware.topology import load_topology
from launcher.plan import search
from launcher.runspec import LaunchSpec
from launcher.runtime import context, wrap
from launcher.runtime.context import RankContext
from launcher.specs import Strategy


@pytest.mark.parametrize("version,name", [
    ("2.13.0", ALLOC_CONF), ("2.9.0", ALLOC_CONF), ("2.9.1+cu128", ALLOC_CONF),
    ("2.9.0rc3", ALLOC_CONF), ("2.10.0.dev20251001+cu130", ALLOC_CONF), ("3.0.0", ALLOC_CONF),
    # before the rename, and 2.9's own nightlies and source builds (the early ones predate it)
    ("2.8.0", CUDA_ALLOC_CONF), ("2.6.0+cpu", CUDA_ALLOC_CONF),
    ("2.9.0.dev20250601", CUDA_ALLOC_CONF), ("2.9.0a0+gitabc123", CUDA_ALLOC_CONF),
    # unknown: the old name, which every version reads
    (None, CUDA_ALLOC_CONF), ("", CUDA_ALLOC_CONF), ("unknown", CUDA_ALLOC_CONF),
])
def test_the_variable_is_named_for_the_torch_that_runs(version, name):
    assert alloc_conf_name(version) == name
    assert alloc_conf_env({}, version) == {name: EXPANDABLE_SEGMENTS}


@pytest.mark.parametrize("version", ["2.13.0", "2.8.0"])
@pytest.mark.parametrize("users", [ALLOC_CONF, CUDA_ALLOC_CONF])
def test_a_user_setting_of_either_name_gets_nothing_added(version, users):
    assert alloc_conf_env({users: "backend:cudaMallocAsync"}, version) == {}


def _spec(**kw) -> LaunchSpec:
    return LaunchSpec(**{**dict(workload="/work/workloads/mlp.py", run_id="r", run_dir="/RUN",
                                gpus=2, steps=10, micro_batch=4, device="cuda",
                                strategy="ddp"), **kw})


def _rank_env(monkeypatch, version: str, spec: LaunchSpec, base_env: dict[str, str]) -> dict[str, str]:
    # raising=False: the old code had no such name (these tests then fail on what it rendered)
    monkeypatch.setattr(torchrun_mod, "installed_torch_version", lambda: version, raising=False)
    return local.render(spec, python="python3", base_env=base_env, cores=4).env


def test_rank_env_names_the_variable_for_the_installed_torch(monkeypatch):
    new = _rank_env(monkeypatch, "2.13.0", _spec(), {})
    assert new[ALLOC_CONF] == EXPANDABLE_SEGMENTS and CUDA_ALLOC_CONF not in new
    old = _rank_env(monkeypatch, "2.8.0", _spec(), {})
    assert old[CUDA_ALLOC_CONF] == EXPANDABLE_SEGMENTS and ALLOC_CONF not in old
    assert not {ALLOC_CONF, CUDA_ALLOC_CONF} & set(_rank_env(monkeypatch, "2.13.0",
                                                             _spec(device="cpu"), {}))


def test_rank_env_leaves_the_users_variable_alone(monkeypatch):
    # in the shell: inherited unchanged, and no second name that torch might read first
    for users in (ALLOC_CONF, CUDA_ALLOC_CONF):
        env = _rank_env(monkeypatch, "2.13.0", _spec(), {users: "backend:cudaMallocAsync"})
        assert not {ALLOC_CONF, CUDA_ALLOC_CONF} & set(env), users
    # in the spec's env: passed on as given (it used to be shadowed by dlaunch's own value)
    env = _rank_env(monkeypatch, "2.13.0", _spec(env={CUDA_ALLOC_CONF: "max_split_size_mb:128"}), {})
    assert env[CUDA_ALLOC_CONF] == "max_split_size_mb:128" and ALLOC_CONF not in env
    env = _rank_env(monkeypatch, "2.8.0", _spec(env={CUDA_ALLOC_CONF: "max_split_size_mb:128"}), {})
    assert env[CUDA_ALLOC_CONF] == "max_split_size_mb:128"


def test_the_plan_names_the_variable_for_the_installed_torch(monkeypatch):
    gpus = load_topology("h100-sxm-8x")
    for version, name in (("2.13.0", ALLOC_CONF), ("2.8.0", CUDA_ALLOC_CONF)):
        monkeypatch.setattr(search, "installed_torch_version", lambda v=version: v, raising=False)
        assert search._env(gpus) == {name: EXPANDABLE_SEGMENTS}


# --- the process group -------------------------------------------------------------------------

def test_an_empty_omp_num_threads_is_unset(monkeypatch):
    # `OMP_NUM_THREADS=` in the shell: each rank's OpenMP would take every core (2 ranks of mlp
    # on 2 cores measured 0.139 s a step instead of 0.022 s); a real value stays the user's
    spec = _spec(device="cpu")
    assert _rank_env(monkeypatch, "2.13.0", spec, {"OMP_NUM_THREADS": ""})["OMP_NUM_THREADS"] == "2"
    assert "OMP_NUM_THREADS" not in _rank_env(monkeypatch, "2.13.0", spec, {"OMP_NUM_THREADS": "3"})


def test_cpu_ranks_tell_accelerate_to_form_a_cpu_group(monkeypatch):
    # Accelerate's Accelerator() joins a gloo group on CPU only when told; otherwise each rank
    # trains an unsynchronised copy and the run looks fine
    cpu = _rank_env(monkeypatch, "2.13.0", _spec(device="cpu"), {})
    assert cpu["ACCELERATE_USE_CPU"] == "1"
    assert "ACCELERATE_USE_CPU" not in _rank_env(monkeypatch, "2.13.0", _spec(device="cpu"),
                                                 {"ACCELERATE_USE_CPU": "0"})  # the user's wins
    assert "ACCELERATE_USE_CPU" not in _rank_env(monkeypatch, "2.13.0", _spec(device="cuda"), {})


def _ctx(world_size: int = 1, device_type: str = "cpu", local_rank: int = 0) -> RankContext:
    return RankContext(rank=local_rank, local_rank=local_rank, world_size=world_size,
                       local_world_size=world_size, node_rank=0, host="h", device_type=device_type)


def test_process_group_arguments_carry_timeout_and_device():
    import torch

    on_gpu = context.process_group_kwargs(_ctx(8, "cuda", local_rank=3), timeout_s=600)
    assert on_gpu == {"backend": "nccl", "timeout": timedelta(seconds=600),
                      "device_id": torch.device("cuda", 3)}
    # the one-rank FSDP run gets the same arguments as a multi-rank one
    assert context.process_group_kwargs(_ctx(1, "cuda"), timeout_s=600)["device_id"] == \
        torch.device("cuda", 0)
    assert context.process_group_kwargs(_ctx(2, "cpu"), timeout_s=60) == \
        {"backend": "gloo", "timeout": timedelta(seconds=60)}


def test_one_rank_starts_a_group_only_for_a_mesh():
    mesh = {kind: wrap.uses_device_mesh(Strategy(kind=kind))
            for kind in ("ddp", "fsdp_full", "fsdp_grad_op", "hybrid")}
    assert mesh == {"ddp": False, "fsdp_full": True, "fsdp_grad_op": True, "hybrid": True}
    assert context.needs_process_group(_ctx(1), mesh=True)
    assert not context.needs_process_group(_ctx(1), mesh=False)  # one-rank DDP is not wrapped
    assert context.needs_process_group(_ctx(2), mesh=False)


def test_init_distributed_starts_the_one_rank_fsdp_group_as_a_multi_rank_one(monkeypatch):
    import torch.distributed as dist

    calls: list[dict] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: calls.append(kw))
    context.init_distributed(_ctx(1), timeout_s=77, mesh=True)
    context.init_distributed(_ctx(1), timeout_s=77, mesh=False)
    context.init_distributed(_ctx(4), timeout_s=77)
    assert calls == [context.process_group_kwargs(_ctx(1), timeout_s=77),
                     context.process_group_kwargs(_ctx(4), timeout_s=77)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_one_rank_fsdp_trains_on_the_group_init_distributed_started(monkeypatch):
    """Real gloo and FSDP2 in this process: the mesh is built on dlaunch's group (its timeout),
    and FSDP refuses to let init_device_mesh start a group of its own."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0",
                 "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    ctx, strategy = _ctx(1), Strategy(kind="fsdp_full", precision="fp32")
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="process group first"):
        wrap.wrap(torch.nn.Linear(4, 4), strategy, ctx, [])
    assert not dist.is_initialized()
    try:
        context.init_distributed(ctx, timeout_s=77, mesh=wrap.uses_device_mesh(strategy))
        group = c10d._get_default_group()
        assert group._get_backend(torch.device("cpu")).options._timeout == timedelta(seconds=77)
        model = torch.nn.Linear(4, 4)
        wrapped = wrap.wrap(model, strategy, ctx, [])
        assert wrapped.mesh_shape == (1,)
        wrapped.module(torch.ones(2, 4)).sum().backward()
        assert model.weight.grad is not None
    finally:
        context.shutdown_distributed()

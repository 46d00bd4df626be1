"""CPU offload (FSDP2's CPUOffloadPolicy): the plan proposes it where nothing else fits the GPUs,
prices the host's memory, link and optimizer step, and refuses a host too small in one line."""

from __future__ import annotations

import dataclasses
import time

import pytest

from launcher.errors import PlanError, UsageError
from launcher.hardware.topology import load_topology, topology_from_dict, topology_to_dict
from launcher.plan.cost import shard_group_size, step_time
from launcher.plan.memory import CUDA_ALLOCATOR_SLACK, MASTER_PARAM_BYTES, estimate_memory
from launcher.plan.offload import (
    HOST_ACCUMULATE_BYTES,
    HOST_ADAMW_FUSED_BYTES_PER_PARAM,
    HOST_ADAMW_LOOP_BYTES_PER_PARAM,
    OFFLOAD_UNPRICED_LINK_SHARE,
    host_bytes,
    offload_s,
)
from launcher.plan.resolve import cached_host_stream, measured_host
from launcher.plan.search import plan
from launcher.plan.types import Overrides
from launcher.plan.view import format_plan
from launcher.runspec import RunSettings
from launcher.specs import GIB, Goal, Strategy

from tests.unit.test_planner import LLAMA3_70B, gpt

LLAMA_7B = gpt("llama-7b", 4096, 32, 32, 32000, 4096, params=6.74e9, tied=False)


def one_h100(**host):
    t = load_topology("h100-sxm-8x").with_shape(num_nodes=1, devices_per_node=1)
    return dataclasses.replace(t, host=dataclasses.replace(t.host, **host)) if host else t


def test_a_7b_model_on_one_h100_is_planned_with_cpu_offload():
    topo = one_h100()
    p = plan(LLAMA_7B, topo, Goal())
    c = p.chosen
    assert c.strategy.offload and c.strategy.shards_params and c.fits
    assert c.memory.total_bytes <= p.usable_mem_bytes
    # params, grads and AdamW state (16 B/param) on the host, none on the GPU
    assert c.memory.params_bytes == c.memory.grads_bytes == c.memory.optimizer_bytes == 0
    assert c.memory.host_bytes == pytest.approx(16 * LLAMA_7B.num_params)
    host_opt = dict(c.time.compute_parts)["host optimizer"]
    # dlaunch's default optimizer steps fused on CUDA ranks
    assert host_opt == pytest.approx(HOST_ADAMW_FUSED_BYTES_PER_PARAM * LLAMA_7B.num_params / 400e9)
    why = " ".join(p.reasons)
    assert "CPU offload: nothing fits without it" in why and "fits from 2 GPUs" in why
    text = format_plan(p, LLAMA_7B, topo)
    assert "CPU offload" in text and "host 100.4 GiB per rank" in text


def test_an_offloaded_plans_reasons_price_its_own_link_and_twins():
    """On 8 GPUs the collectives and the host link both move bytes: the offload reason names the
    link's seconds alone, and the checkpointing reason weighs the offloaded plan's own modes."""
    topo = load_topology("h100-sxm-8x")
    p = plan(LLAMA3_70B, topo, Goal())
    c = p.chosen
    assert c.strategy.offload and c.strategy.checkpointing == "full"
    link = offload_s(LLAMA3_70B, c.strategy, topo, shard_group_size(c.strategy.kind, topo), 0.0, 0.0,
                     c.grad_accum)[0]
    assert 0 < link < c.time.comm_total_s  # the FSDP collectives are not the host link's
    offload = next(r for r in p.reasons if r.startswith("CPU offload:"))
    assert f"host link, {link:.3g} s of traffic a step" in offload
    ckpt = next(r for r in p.reasons if r.startswith("activation checkpointing"))
    assert ckpt.count("selective needs") == ckpt.count("every-other needs") == 1


def test_a_host_too_small_is_one_line_naming_what_is_needed():
    with pytest.raises(PlanError) as err:
        plan(LLAMA_7B, one_h100(mem_gib=64), Goal())
    msg = str(err.value)
    assert "\n" not in msg
    assert "needs 100.4 GiB of host memory per node" in msg and "the node has 64.0 GiB" in msg


def test_offload_is_not_proposed_where_the_model_fits_without_it():
    p = plan(LLAMA_7B, load_topology("h100-sxm-8x"), Goal())
    assert not p.chosen.strategy.offload
    assert not any("offload" in r for r in p.reasons)


def test_forced_offload_costs_time_and_needs_fsdp_and_a_described_host():
    topo = one_h100()
    forced = plan(LLAMA_7B, load_topology("h100-sxm-8x"), Goal(global_batch=8),
                  overrides=Overrides(strategy="fsdp_full", micro_batch=1, offload=True))
    free = plan(LLAMA_7B, load_topology("h100-sxm-8x"), Goal(global_batch=8),
                overrides=Overrides(strategy="fsdp_full", micro_batch=1, checkpointing=
                                    forced.chosen.strategy.checkpointing, offload=False))
    assert forced.chosen.strategy.offload and not free.chosen.strategy.offload
    assert forced.chosen.time.step_time_s > free.chosen.time.step_time_s
    assert forced.chosen.memory.total_bytes < free.chosen.memory.total_bytes
    with pytest.raises(PlanError, match="--offload keeps FSDP's sharded state"):
        Overrides(strategy="ddp", offload=True)
    with pytest.raises(PlanError, match="does not describe its hosts"):
        plan(LLAMA_7B, dataclasses.replace(topo, host=None), Goal(), overrides=Overrides(offload=True))
    with pytest.raises(UsageError, match="`offload` keeps FSDP's sharded state"):
        RunSettings(strategy="zero1", offload=True)


def test_the_link_hides_behind_compute_until_it_is_longer():
    topo = one_h100()
    s = Strategy(kind="fsdp_full", precision="bf16", offload=True)
    local = LLAMA_7B.num_params
    total, exposed, host = offload_s(LLAMA_7B, s, topo, 1, fwd_s=100.0, bwd_s=200.0, grad_accum=2)
    assert total == pytest.approx(2 * 12 * local / 55e9) and exposed == 0
    _, exposed, _ = offload_s(LLAMA_7B, s, topo, 1, fwd_s=0.0, bwd_s=0.0, grad_accum=1)
    assert exposed == pytest.approx(12 * local / 55e9)  # forward's copy in + backward's in, then its out
    grad_op = dataclasses.replace(s, kind="fsdp_grad_op")
    assert offload_s(LLAMA_7B, grad_op, topo, 1, 0.0, 0.0, 1)[0] == pytest.approx(8 * local / 55e9)
    assert host_bytes(LLAMA_7B, s, 4, 8.0) == pytest.approx(16 * local / 4)
    t = step_time(LLAMA_7B, s, topo, 1, 1)
    assert t.comm_total_s == pytest.approx(12 * local / 55e9)


def test_the_host_block_round_trips_and_is_checked():
    t = load_topology("h100-sxm-8x")
    assert topology_from_dict(topology_to_dict(t)) == t
    bad = topology_to_dict(t)
    bad["host"]["link_gb_s"] = -1
    with pytest.raises(Exception, match="host.link_gb_s"):
        topology_from_dict(bad)
    assert t.host is not None and t.host.mem_gib * GIB > 1e12


def test_the_host_step_is_priced_by_the_optimizers_kernel():
    """A workload's unfused AdamW runs the per-tensor loop on the host, several times the fused kernel's traffic;
    dlaunch's own default steps fused on CUDA ranks and loops on CPU ones."""
    topo = one_h100()
    s = Strategy(kind="fsdp_full", precision="bf16", offload=True)
    per_byte = LLAMA_7B.num_params / 400e9
    host = {fused: offload_s(dataclasses.replace(LLAMA_7B, optimizer_fused=fused), s, topo, 1, 0.0, 0.0, 1)[2]
            for fused in (None, True, False)}
    assert host[None] == host[True] == pytest.approx(HOST_ADAMW_FUSED_BYTES_PER_PARAM * per_byte)
    assert host[False] == pytest.approx(HOST_ADAMW_LOOP_BYTES_PER_PARAM * per_byte)
    cpu = dataclasses.replace(topo, device="cpu")
    assert offload_s(LLAMA_7B, s, cpu, 1, 0.0, 0.0, 1)[2] == pytest.approx(host[False])


def test_an_offloaded_unit_s_fp32_copy_is_on_the_gpu():
    """FSDP2 copies the prefetched unit's fp32 shard to the GPU before casting it for the all-gather."""
    s = Strategy(kind="fsdp_full", precision="bf16", offload=True)
    kw = dict(micro_batch=1, world_size=1, shard_group_size=1, device="cuda")
    on, off = estimate_memory(LLAMA_7B, s, **kw), estimate_memory(LLAMA_7B, dataclasses.replace(s, offload=False), **kw)
    kept = off.params_bytes + off.grads_bytes + off.optimizer_bytes
    fp32_copy = MASTER_PARAM_BYTES * LLAMA_7B.largest_block_params
    assert on.total_bytes - off.total_bytes == pytest.approx((fp32_copy - kept) * (1 + CUDA_ALLOCATOR_SLACK))
    assert "fp32 shard copied in" in on.assumptions


def test_this_hosts_memory_bandwidth_is_measured_once_and_replaces_the_assumed_figure(tmp_path):
    import torch

    stream = cached_host_stream(tmp_path)
    # every core streaming moves at least what one thread does over the same 1 GiB
    x, threads = torch.ones(1 << 27), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t0 = time.perf_counter()
        torch.add(x, 1.0, out=torch.empty_like(x))
        one = 8 * x.numel() / (time.perf_counter() - t0) / 1e9
    finally:
        torch.set_num_threads(threads)
    assert stream.gb_s > 0.7 * one
    assert cached_host_stream(tmp_path, measure_fn=lambda: pytest.fail("measured again")) == stream
    gpu = one_h100()
    host = measured_host(gpu, stream)
    assert (host.mem_bw_gb_s, host.link_gb_s, host.mem_gib) == (stream.gb_s, gpu.host.link_gb_s, gpu.host.mem_gib)
    assert host.mem_bw_measured and not gpu.host.mem_bw_measured
    # a CPU node's "link" is the same memory: measured too
    assert measured_host(dataclasses.replace(gpu, device="cpu"), stream).link_gb_s == stream.gb_s
    # the plan says which figure the host step was priced at
    p = plan(LLAMA_7B, dataclasses.replace(gpu, host=host), Goal())
    offload = next(r for r in p.reasons if r.startswith("CPU offload:"))
    assert f"{stream.gb_s:g} GB/s of host memory bandwidth (measured here)" in offload
    listed = next(r for r in plan(LLAMA_7B, gpu, Goal()).reasons if r.startswith("CPU offload:"))
    assert "(the topology figure)" in listed


def test_an_offloaded_plans_interval_widens_by_what_its_copies_took_past_their_price():
    topo = one_h100()
    on = plan(LLAMA_7B, topo, Goal(global_batch=8), overrides=Overrides(strategy="fsdp_full", micro_batch=1,
                                                                        checkpointing="full", offload=True))
    c = on.chosen
    link = offload_s(LLAMA_7B, c.strategy, topo, 1, 0.0, 0.0, c.grad_accum)[0]
    wide = 1 + OFFLOAD_UNPRICED_LINK_SHARE * link / c.time.step_time_s
    assert wide > 1.1 and "CPU offload's copies" in on.step_interval.basis
    assert f"(up to {wide:.2f}x)" in on.step_interval.basis
    off = plan(LLAMA_7B, load_topology("h100-sxm-8x").with_shape(num_nodes=1, devices_per_node=2),
               Goal(global_batch=8), overrides=Overrides(strategy="fsdp_full", micro_batch=1, checkpointing="full"))
    assert "CPU offload" not in off.step_interval.basis


def test_the_bandwidth_probe_streams_on_every_usable_core_whatever_the_threads_are_set_to(monkeypatch):
    """Its cache is keyed by the usable cores: a plan under OMP_NUM_THREADS=1 must not store one thread's rate."""
    import torch

    from launcher.hardware.detect import cpu_info
    from launcher.plan.cpu_probe import host_stream

    seen, add, threads = [], torch.add, torch.get_num_threads()
    monkeypatch.setattr(torch, "add", lambda *a, **k: seen.append(torch.get_num_threads()) or add(*a, **k))
    torch.set_num_threads(1)
    try:
        assert host_stream().gb_s > 0
        assert torch.get_num_threads() == 1  # restored
    finally:
        torch.set_num_threads(threads)
    assert seen and set(seen) == {cpu_info().usable_cores}


def test_a_host_that_cannot_hold_the_fp32_model_built_before_sharding_is_warned():
    """A sharded run's model is built in host memory by rank 0 alone (runtime.build): Llama 3 70B's 263 GiB fit a
    DGX H100's 1,907 GiB, not a 200 GiB host; a run that is not sharded builds it on every rank of the node."""
    topo = dataclasses.replace(load_topology("h100-sxm-8x4node-ib"), host=load_topology("h100-sxm-8x").host)
    assert not [r for r in plan(LLAMA3_70B, topo, Goal()).reasons if "builds the whole fp32 model" in r]
    small = dataclasses.replace(topo, host=dataclasses.replace(topo.host, mem_gib=200))
    warned = [r for r in plan(LLAMA3_70B, small, Goal()).reasons if "builds the whole fp32 model" in r]
    assert len(warned) == 1 and warned[0].startswith("warning: rank 0 builds"), warned
    assert f"({MASTER_PARAM_BYTES * LLAMA3_70B.num_params / GIB:,.0f} GiB against the node's 200 GiB)" in warned[0]
    tiny = dataclasses.replace(topo, host=dataclasses.replace(topo.host, mem_gib=1))
    ddp = plan(gpt("small", 768, 12, 12, 50257, 1024, params=124e6, tied=True), tiny, Goal(),
               overrides=Overrides(strategy="ddp"))
    assert [r for r in ddp.reasons if r.startswith("warning: each of the node's 8 ranks builds")], ddp.reasons


@pytest.mark.parametrize("optimizer, state_b, share", [("", 0.0, 1.0), ("SGD (make_optimizer)", 4.0, 20 / 28),
                                                      ("SGD (make_optimizer)", 0.0, 12 / 28)])
def test_the_optimizer_step_is_priced_by_the_workloads_own_optimizer(optimizer, state_b, share):
    """AdamW's step reads param, grad and two moments and writes three (28 B a parameter); SGD with
    momentum 20 B, without 12: the GPU's step, the CPU's and the offloaded host's (fused kernel or
    per-tensor loop; accumulation's adds are the gradients', not the optimizer's) scale alike. A
    profile that names no optimizer (state 0 given here) is priced as AdamW."""
    from launcher.plan.cost import optimizer_s
    from launcher.plan.cpu_cost import cpu_optimizer_s

    adamw = dataclasses.replace(LLAMA_7B, optimizer="AdamW (default)", optimizer_state_bytes_per_param=8.0)
    other = dataclasses.replace(LLAMA_7B, optimizer=optimizer, optimizer_state_bytes_per_param=state_b)
    gpu, s = one_h100(), Strategy(kind="fsdp_full", precision="bf16", offload=True)
    cpu = load_topology("cpu-local").with_shape(num_nodes=1, devices_per_node=2)
    assert optimizer_s(other, 8, gpu.accelerator) == pytest.approx(share * optimizer_s(adamw, 8, gpu.accelerator))
    for fused in (True, False):
        host = {p.optimizer_state_bytes_per_param: offload_s(dataclasses.replace(p, optimizer_fused=fused),
                                                             s, gpu, 1, 0.0, 0.0, 4)[2] for p in (adamw, other)}
        adds = 3 * HOST_ACCUMULATE_BYTES * LLAMA_7B.num_params / 400e9
        assert host[state_b] - adds == pytest.approx(share * (host[8.0] - adds))
    # on CPU its smaller working set may stream at another rate: within 5% of the bytes' share
    assert cpu_optimizer_s(other, 2, cpu) == pytest.approx(share * cpu_optimizer_s(adamw, 2, cpu), rel=0.05)


def test_the_goals_optimizer_prices_the_step_of_a_profile_that_names_none():
    """The plan's memory counts the goal's optimizer's state where the profile names no optimizer;
    its step time prices the same optimizer: SGD's step on 8 GPUs is 20/28 of AdamW's."""
    unnamed = dataclasses.replace(LLAMA_7B, optimizer="", optimizer_state_bytes_per_param=0.0)
    topo = load_topology("h100-sxm-8x")
    ov = Overrides(strategy="fsdp_full", precision="bf16", micro_batch=1, checkpointing="full")
    steps = {name: dict(plan(unnamed, topo, Goal(optimizer=name), overrides=ov).chosen.time.compute_parts)["optimizer"]
             for name in ("adamw", "sgd")}
    assert steps["sgd"] == pytest.approx(20 / 28 * steps["adamw"])

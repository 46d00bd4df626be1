"""ZeRO-1 (`zero1`: DDP with the optimizer state sharded over the ranks) in the plan and in
its checkpoint.

- memory: DDP's estimate less (N-1)/N of the optimizer state, nothing else;
- step time: DDP's all-reduce plus the parameter sync after the step, exposed (GPU and CPU);
- the planner takes it where DDP does not fit and FSDP's traffic costs more (4 x T4, PCIe);
- tensor parallelism is refused as for DDP;
- the optimizer shard of a checkpoint (runtime.zero) comes back as saved, also when the
  checkpoint was written by more ranks than load it.
The losses of real zero1 runs against DDP: tests/integration/test_equivalence.py (4 ranks) and
tests/integration/test_resume.py (2 ranks, across a restart).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from launcher.errors import PlanError, UsageError
from launcher.hardware.types import Link
from launcher.plan.candidates import check_forced
from launcher.plan.collectives import zero1_sync_s
from launcher.plan.cost import step_time
from launcher.plan.cpu_comm import cpu_ddp_comm, cpu_zero1_sync
from launcher.plan.memory import estimate_memory
from launcher.plan.search import plan
from launcher.plan.types import Overrides
from launcher.runtime import zero
from launcher.specs import Goal, Strategy

from tests.unit.test_planner import GPT_1_3B, GPT_TINY, gpt, topology


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero1_memory_is_ddps_less_the_other_ranks_optimizer_state(device, world, precision):
    def est(kind: str):  # the planner passes zero1 the world as its shard group
        return estimate_memory(GPT_1_3B, Strategy(kind=kind, precision=precision), micro_batch=4,
                               world_size=world, shard_group_size=1 if kind == "ddp" else world,
                               device=device)

    ddp, z = est("ddp"), est("zero1")
    saved = ddp.optimizer_bytes * (world - 1) / world
    assert z.optimizer_bytes == pytest.approx(ddp.optimizer_bytes - saved)
    for term in ("params_bytes", "grads_bytes", "activations_bytes"):
        assert getattr(z, term) == getattr(ddp, term), term
    if device == "cpu":
        assert z.total_bytes == pytest.approx(ddp.total_bytes - saved)
    else:  # less state, less allocator slack (a share of the tensors)
        assert ddp.total_bytes - saved - 0.06 * saved < z.total_bytes < ddp.total_bytes - saved
    assert f"optimizer state / {world} (ZeRO-1)" in z.assumptions


def test_zero1_on_one_rank_is_ddp():
    one = {k: estimate_memory(GPT_TINY, Strategy(kind=k), micro_batch=4, world_size=1,
                              shard_group_size=1, device="cpu") for k in ("ddp", "zero1")}
    assert one["zero1"] == one["ddp"]


def test_zero1_step_is_ddps_plus_the_exposed_parameter_sync():
    topo = topology("a100-pcie-8x")
    ddp = step_time(GPT_1_3B, Strategy(kind="ddp", precision="bf16"), topo, 4, 4)
    z = step_time(GPT_1_3B, Strategy(kind="zero1", precision="bf16"), topo, 4, 4)
    sync = zero1_sync_s(GPT_1_3B, topo)
    # the full fp32 parameters over the ring in one all-gather, each rank's 1/n
    link, n, nbytes = topo.intra_node, 8, 4 * GPT_1_3B.num_params
    expected = (n - 1) / n * nbytes / (link.bw_gb_s * 1e9) + (n - 1) * link.latency_us * 1e-6
    assert sync == pytest.approx(expected)
    assert z.comm_total_s == pytest.approx(ddp.comm_total_s + sync)
    assert z.comm_exposed_s == pytest.approx(ddp.comm_exposed_s + sync)
    # its optimizer steps an eighth of the parameters
    assert dict(z.compute_parts)["optimizer"] == pytest.approx(dict(ddp.compute_parts)["optimizer"] / 8)


def test_zero1_on_cpu_ranks_adds_its_all_gather_to_ddps_comm():
    topo = topology("cpu-local")
    z = step_time(GPT_TINY, Strategy(kind="zero1"), topo, 4, 1)
    assert z.comm_total_s == z.comm_exposed_s == pytest.approx(
        cpu_ddp_comm(GPT_TINY, topo) + cpu_zero1_sync(GPT_TINY, topo))
    assert cpu_zero1_sync(GPT_TINY, topo) > 0


def test_planner_takes_zero1_where_ddp_does_not_fit_and_fsdp_costs_more():
    # a 0.76B GPT on 4 x T4 (15 GiB, PCIe): DDP's 16 B/param of state does not fit, zero1's
    # 4 + 4 + 8/4 does, and FSDP's per-unit gathers over PCIe cost more than zero1's one sync
    model = gpt("gpt-d1536", 1536, 24, 12, 50257, 1024)
    p = plan(model, topology("t4-4x"), Goal(global_batch=128))
    assert p.chosen.strategy.kind == "zero1", p.reasons
    fitting = [c for c in p.rejected if c.fits]
    assert not any(c.strategy.kind == "ddp" for c in fitting)
    fsdp = [c for c in fitting if c.strategy.kind.startswith("fsdp")]
    assert fsdp and all(c.time.step_time_s > p.chosen.time.step_time_s for c in fsdp)
    why = "\n".join(p.reasons)
    assert why.startswith("ZeRO-1 fits") and "DDP does not fit" in why


def test_zero1_is_proposed_over_several_ranks_only():
    one = dataclasses.replace(topology("cpu-local"), devices_per_node=1)
    p = plan(GPT_TINY, one, Goal(global_batch=8))
    assert {c.strategy.kind for c in [p.chosen, *p.rejected]} == {"ddp"}
    four = plan(GPT_TINY, topology("cpu-local"), Goal(global_batch=8))
    assert "zero1" in {c.strategy.kind for c in [four.chosen, *four.rejected]}


def test_zero1_refuses_tensor_parallelism_like_ddp():
    with pytest.raises(UsageError, match="zero1 does not"):
        Strategy(kind="zero1", tp=2)
    model = dataclasses.replace(GPT_1_3B, tp_degrees=(2, 4, 8))
    with pytest.raises(PlanError, match="nor does ZeRO-1"):
        check_forced(Overrides(strategy="zero1", tp=2), model, topology("h100-sxm-8x"))
    assert not Strategy(kind="zero1").shards_params and Strategy(kind="fsdp_full").shards_params


# --- the optimizer shard of a checkpoint (one process, a gloo group of one) ------------------------
@pytest.fixture
def gloo_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def _workload_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """Two groups, as a workload's make_optimizer gives them: no weight decay on biases."""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return torch.optim.AdamW([{"params": weights}, {"params": biases, "weight_decay": 0.0}],
                             lr=1e-2, betas=(0.8, 0.95))


def _trained(steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model()
    opt = zero.ZeroOptimizer(_workload_optimizer(model))
    for _ in range(steps):
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def test_zero1_keeps_the_workloads_optimizer_class_groups_and_hyperparameters(gloo_group):
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = zero.ZeroOptimizer(_workload_optimizer(model))
    assert zero.is_zero(opt) and type(opt.optim) is torch.optim.AdamW
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]
    assert all(g["betas"] == (0.8, 0.95) and g["lr"] == 1e-2 for g in opt.optim.param_groups)
    assert not zero.is_zero(_workload_optimizer(model))
    # the parameters are views of one flat buffer now, with their values; the pieces cover them
    (flat,) = opt.flats
    assert all(p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert sum(piece.numel() for piece, *_ in opt.pieces) == sum(p.numel() for p in model.parameters())


def test_zero1_steps_as_the_workloads_optimizer_does(gloo_group):
    torch.manual_seed(1)
    batches = [torch.randn(4, 8) for _ in range(3)]
    models = []
    for make in (lambda m: _workload_optimizer(m), lambda m: zero.ZeroOptimizer(_workload_optimizer(m))):
        model = _model()
        opt = make(model)
        for x in batches:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        models.append(model)
    for a, b in zip(*(m.parameters() for m in models)):
        assert torch.allclose(a, b, rtol=0, atol=1e-7)


def test_a_zero1_shard_comes_back_as_saved_also_from_more_ranks(gloo_group, tmp_path):
    _, opt = _trained(3)
    opt.param_groups[1]["lr"] = 5e-3  # a scheduler's change: saved with the groups
    name, shard = zero.shard(opt, 0)
    sizes = {0: 128, 1: 32, 2: 16, 3: 2}  # over the groups: weights (8x16, 16x2), then biases
    assert name == "optim-zero-0.pt" and shard["ranges"] == {i: (0, n) for i, n in sizes.items()}
    # as two ranks would have written it: rank 0 the first 89 elements of parameter 0, rank 1 the rest
    # of it and every other parameter
    def piece(i: int, start: int, stop: int) -> dict:
        return {k: v[start:stop] if v.dim() else v for k, v in shard["state"][i].items()}

    torch.save({"state": {0: piece(0, 0, 89)}, "ranges": {0: (0, 89)}, "param_groups": shard["param_groups"]},
               tmp_path / "optim-zero-0.pt")
    torch.save({"state": {0: piece(0, 89, 128), **{i: piece(i, 0, sizes[i]) for i in (1, 2, 3)}},
                "ranges": {0: (89, 128), **{i: (0, sizes[i]) for i in (1, 2, 3)}},
                "param_groups": shard["param_groups"]}, tmp_path / "optim-zero-1.pt")
    _, fresh = _trained(0)
    zero.load_shards(fresh, tmp_path)
    assert fresh.param_groups[1]["lr"] == fresh.optim.param_groups[1]["lr"] == 5e-3
    assert not fresh.state  # the wrapper keeps no second copy of the loaded state
    for piece_, _, i, _, _ in fresh.pieces:
        for key, value in shard["state"][i].items():
            assert torch.equal(fresh.optim.state[piece_][key], value), (i, key)
    # a shard of whole parameters (no "ranges", each state the parameter's shape) reads too
    params = [p for g in fresh.param_groups for p in g["params"]]
    whole = {i: {k: v.reshape(params[i].shape) if v.dim() else v for k, v in s.items()}
             for i, s in shard["state"].items()}
    for path in tmp_path.glob("optim-zero-*.pt"):
        path.unlink()
    torch.save({"state": whole, "param_groups": shard["param_groups"]}, tmp_path / "optim-zero-0.pt")
    _, fresh = _trained(0)
    zero.load_shards(fresh, tmp_path)
    assert all(torch.equal(fresh.optim.state[p][k], v) for p, _, i, _, _ in fresh.pieces
               for k, v in shard["state"][i].items())


def test_zero1_takes_elementwise_optimizers_only_and_aligns_each_parameter(gloo_group):
    model = _model()
    with pytest.raises(UsageError, match="update each element on its own.*Adafactor: use --strategy ddp"):
        zero.ZeroOptimizer(torch.optim.Adafactor(model.parameters()))
    opt = zero.ZeroOptimizer(_workload_optimizer(model))
    (flat,) = opt.flats
    assert all((p.data_ptr() - flat.data_ptr()) // 4 % zero.ALIGN == 0 for p in model.parameters())


def test_shards_that_miss_part_of_a_piece_are_a_value_error(gloo_group, tmp_path):
    _, opt = _trained(1)
    _, shard = zero.shard(opt, 0)
    cut = {k: v[:100] if v.dim() else v for k, v in shard["state"][0].items()}
    torch.save({"state": {**shard["state"], 0: cut}, "ranges": {**shard["ranges"], 0: (0, 100)},
                "param_groups": shard["param_groups"]}, tmp_path / "optim-zero-0.pt")
    _, fresh = _trained(0)
    with pytest.raises(ValueError, match="hold 100 of the 128 elements of parameter 0"):
        zero.load_shards(fresh, tmp_path)


def test_an_old_shard_of_a_scalar_parameter_steps_again(gloo_group, tmp_path):
    # shards written before the pieces hold whole parameters in their own shape: a scalar's state is 0-dim
    model = torch.nn.Linear(4, 1)
    model.register_parameter("scale", torch.nn.Parameter(torch.tensor(2.0)))
    opt = zero.ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    (model(torch.randn(2, 4)) * model.scale).sum().backward()
    opt.step()
    _, shard = zero.shard(opt, 0)
    shapes = [p.shape for p in model.parameters()]
    whole = {i: {k: v.reshape(shapes[i]) if k != "step" else v for k, v in st.items()}
             for i, st in shard["state"].items()}
    assert whole[2]["exp_avg"].dim() == 0
    torch.save({"state": whole, "param_groups": shard["param_groups"]}, tmp_path / "optim-zero-0.pt")
    zero.load_shards(opt, tmp_path)
    (model(torch.randn(2, 4)) * model.scale).sum().backward()
    opt.step()  # the scalar's moments came back as its 1-element piece's


def test_a_checkpoint_without_zero1_shards_is_one_line(gloo_group, tmp_path):
    _, opt = _trained(0)
    with pytest.raises(FileNotFoundError, match="no zero1 optimizer shards"):
        zero.load_shards(opt, tmp_path)


def test_zero1_sync_prices_the_slowest_link_across_nodes():
    topo = topology("a100-sxm-8x2node-roce")
    one_node = dataclasses.replace(topo, num_nodes=1, inter_node=None)
    assert zero1_sync_s(GPT_1_3B, topo) > 5 * zero1_sync_s(GPT_1_3B, one_node)
    slow = dataclasses.replace(one_node, intra_node=Link(kind="pcie", bw_gb_s=10, latency_us=8))
    assert zero1_sync_s(GPT_1_3B, slow) > zero1_sync_s(GPT_1_3B, one_node)

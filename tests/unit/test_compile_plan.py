"""torch.compile in the plan: proposed on GPUs where Dynamo traces one forward of the workload
without a graph break (on the meta device, cached beside the profile), declined with the break
named, priced by the cost model (only the memory-bound passes get faster), never proposed on CPU
(CPU step times unchanged), and followed by `dlaunch run` unless --compile/--no-compile says."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import pytest

from launcher.hardware.topology import load_topology
from launcher.plan import resolve
from launcher.plan.compile_choice import CPU_REASON, MIN_COMPILE_GAIN
from launcher.plan.compile_probe import CompileCheck, check_compile
from launcher.plan.cost import COMPILE_MEMORY_FACTOR, forward_pass
from launcher.plan.resolve import Planned, cached_compile_check
from launcher.plan.search import plan
from launcher.plan.types import Overrides
from launcher.request import RunRequest
from launcher.specs import Goal, ModelProfile
from launcher.workload import load_workload

from tests.helpers import DATA, WORKLOADS, assert_one_line_error

GPT = str(WORKLOADS / "gpt.py")
BREAK = str(DATA / "graph_break.py")
H100 = load_topology("h100-sxm-8x")
CLEAN = CompileCheck(model_graphs=1, model_breaks=0, blocks_traced=1, block_graphs=1)


def gpt_profile(d: int = 768, layers: int = 12, vocab: int = 50304, seq: int = 1024) -> ModelProfile:
    """An analytic GPT shape (as tests/unit/test_planner.py builds them)."""
    p = 12 * layers * d * d + vocab * d
    return ModelProfile(
        name="gpt", num_params=p, bytes_by_dtype={"float32": 4 * p}, num_blocks=layers,
        largest_block_params=12 * d * d,
        activation_bytes_per_sample=2 * layers * seq * d * (34 + 5 * 12 * seq / d) + seq * vocab * 4,
        block_input_bytes_per_sample=seq * d * 4, flops_fwd_per_sample=2 * p * seq,
        units_per_sample=seq, sample_units="tokens")


GPT_SMALL = gpt_profile()
# a toy that fits a CPU rank: the planner's CPU path, from the topology's listed rates
TOY = ModelProfile(name="toy", num_params=10**6, bytes_by_dtype={"fp32": 4 * 10**6}, num_blocks=4,
                   largest_block_params=250_000, activation_bytes_per_sample=1e6,
                   block_input_bytes_per_sample=1e4, flops_fwd_per_sample=1e9)


# --- the acceptance: `dlaunch plan` on 8 H100 ---------------------------------------------------
def test_plan_proposes_compile_for_gpt_on_h100_and_prices_it(dlaunch):
    done = dlaunch("plan", GPT, "--topology", "h100-sxm-8x", "--", "--size", "small")
    assert done.code == 0, done.err
    lines = done.out.splitlines()
    assert "compile (default)" in lines[1]  # the strategy line
    why = next(line for line in lines if line.startswith("  - compile: proposed"))
    assert "0 graph breaks" in why and "--no-compile runs eagerly" in why
    eager, fused, gain = re.search(r"([\d.]+) -> ([\d.]+) s/step predicted \(\+(\d+)% throughput\)",
                                   why).groups()
    assert float(fused) < float(eager) and int(gain) > 0
    basis = next(line for line in lines if line.startswith("  - compile's gain:"))
    assert f"x{COMPILE_MEMORY_FACTOR:g}" in basis and "5,762 -> 6,667" in basis  # labelled

    data = json.loads(dlaunch("plan", GPT, "--topology", "h100-sxm-8x", "--json",
                              "--", "--size", "small").out)["plan"]
    decision = data["compile"]
    assert decision["compile"] is data["chosen"]["strategy"]["compile"] is True
    assert (decision["decided_by"], decision["graph_breaks"]) == ("dynamo trace", 0)
    assert decision["compiled_step_time_s"] < decision["eager_step_time_s"]
    chosen = data["chosen"]["time"]
    step_s = chosen["compute_s"] + chosen["comm_exposed_s"] + chosen["contention_s"] + chosen["sync_wait_s"]
    assert decision["compiled_step_time_s"] == pytest.approx(step_s)  # the plan's own prediction


def test_a_graph_break_declines_compile_and_names_it(dlaunch):
    done = dlaunch("plan", BREAK, "--topology", "h100-sxm-8x", "--json")
    assert done.code == 0, done.err
    decision = json.loads(done.out)["plan"]["compile"]
    assert decision["compile"] is False and decision["graph_breaks"] >= 1
    assert "print" in decision["first_break"] and "graph_break.py:18" in decision["first_break"]
    assert decision["reason"].startswith("compile: not proposed: Dynamo breaks the graph")
    text = dlaunch("plan", BREAK, "--topology", "h100-sxm-8x").out
    assert "no compile" in text.splitlines()[1] and "graph_break.py:18" in text


# --- the trace ----------------------------------------------------------------------------------
EARLY_BREAK = '''
import torch
import torch.nn.functional as F
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 4)

    def forward(self, x):
        print("forward")  # before the first op: no graph ends here
        return self.a(x)

def build_model(cfg):
    return Net()

class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.randn(16, generator=torch.Generator().manual_seed(i)), i % 4

def make_dataset(cfg, num_samples):
    return Data()

def loss_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)
'''


def test_the_trace_finds_breaks_in_blocks_and_before_the_first_op(tmp_path: Path, capsys):
    broken = check_compile(load_workload(BREAK))
    assert broken.error == "" and broken.blocks_traced == 1
    assert broken.block_breaks >= 1 and broken.model_breaks >= 1
    assert broken.breaks("fsdp_full") == (broken.block_breaks, broken.block_break)
    early = tmp_path / "early.py"
    early.write_text(EARLY_BREAK)
    check = check_compile(load_workload(early))
    # explain records no break reason for it; Dynamo's break counter does
    assert check.model_breaks == 1 and "print" in check.model_break and check.blocks_traced == 0
    assert check.breaks("fsdp_full") == check.breaks("ddp")  # no blocks: the whole model compiles
    clean = check_compile(load_workload(GPT))
    assert (clean.model_breaks, clean.block_breaks, clean.error) == (0, 0, "")
    assert clean.model_graphs == 1 and clean.blocks_traced == 1


def test_the_trace_is_cached_beside_the_profile(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("DLAUNCH_CACHE_DIR", str(tmp_path))
    first = cached_compile_check(BREAK, [])
    assert resolve.compile_cache_path(BREAK, []).parent == resolve.profile_cache_dir()

    def traced_again(workload):
        raise AssertionError("traced again despite the cache")

    monkeypatch.setattr(resolve, "check_compile", traced_again)
    assert cached_compile_check(BREAK, []) == first


# --- the decision (pure) ------------------------------------------------------------------------
def test_clean_trace_on_a_gpu_proposes_compile_priced_on_memory_bound_work_only():
    same = Overrides(strategy="fsdp_full", micro_batch=4, checkpointing="full")
    p = plan(GPT_SMALL, H100, Goal(global_batch=256), overrides=same, compile_check=CLEAN)
    d = p.compile
    assert p.chosen.strategy.compile and d.compile and d.decided_by == "dynamo trace"
    eager = plan(GPT_SMALL, H100, Goal(global_batch=256), overrides=dataclasses.replace(same, compile=False))
    assert eager.chosen.strategy.compile is False and eager.compile.decided_by == "--no-compile"
    assert d.eager_step_time_s == pytest.approx(eager.chosen.time.step_time_s)
    assert d.compiled_step_time_s == pytest.approx(p.chosen.time.step_time_s)
    c = p.chosen
    fused = forward_pass(GPT_SMALL, c.strategy, c.micro_batch, H100.accelerator)
    plain = forward_pass(GPT_SMALL, eager.chosen.strategy, c.micro_batch, H100.accelerator)
    assert (fused.gemm_s, fused.attention_s) == (plain.gemm_s, plain.attention_s)  # untouched
    assert fused.memory_s == pytest.approx(plain.memory_s * COMPILE_MEMORY_FACTOR)
    # the compute saved: the memory-bound passes of forward, recompute and backward (2x)
    saved = c.grad_accum * (1 + 1 + 2) * (plain.memory_s - fused.memory_s)
    assert eager.chosen.time.compute_s - c.time.compute_s == pytest.approx(saved)
    assert any(r.startswith("compile: proposed") for r in p.reasons)
    assert any(r.startswith("compile's gain:") for r in p.reasons)


def test_the_loss_outside_the_compiled_forward_stays_unfused():
    """dlaunch compiles the model's forward; the workload's loss_fn takes the loss of its logits outside it:
    a language model's log_softmax traffic (its logits: half the loss gradient's transient) is not fused."""
    logits = 1024 * 50304 * 4
    lm = dataclasses.replace(GPT_SMALL, backward_transient_bytes_per_sample=2 * logits)
    on, off = (Overrides(strategy="ddp", micro_batch=8, checkpointing="none", compile=c) for c in (True, False))
    fused, plain = (forward_pass(lm, plan(lm, H100, Goal(global_batch=64), overrides=o).chosen.strategy, 8,
                                 H100.accelerator) for o in (on, off))
    share = logits / lm.activation_bytes_per_sample
    assert 0.05 < share < 0.5
    assert fused.memory_s == pytest.approx(plain.memory_s * (COMPILE_MEMORY_FACTOR * (1 - share) + share))
    fused_loss = dataclasses.replace(lm, loss_kernel="fused")  # a fused loss kernel is priced by its own passes
    assert (forward_pass(fused_loss, plan(lm, H100, Goal(global_batch=64), overrides=on).chosen.strategy, 8,
                         H100.accelerator).memory_s < fused.memory_s)


def test_fsdp_compiles_per_block_so_a_break_outside_the_blocks_declines_only_ddp():
    outside = CompileCheck(model_graphs=2, model_breaks=1, model_break="x (gpt.py:1)",
                           blocks_traced=1, block_graphs=1)
    ddp = plan(GPT_SMALL, H100, Goal(global_batch=256), overrides=Overrides(strategy="ddp"),
               compile_check=outside)
    assert not ddp.chosen.strategy.compile and ddp.compile.graph_breaks == 1
    assert "x (gpt.py:1)" in ddp.compile.reason
    fsdp = plan(GPT_SMALL, H100, Goal(global_batch=256), overrides=Overrides(strategy="fsdp_full"),
                compile_check=outside)
    assert fsdp.chosen.strategy.compile and fsdp.compile.graph_breaks == 0
    assert "each block's forward, before FSDP2's fully_shard" in fsdp.compile.reason
    assert fsdp.chosen.strategy.compile_mode == "default"  # no CUDA graphs under FSDP


@pytest.mark.parametrize("check, decided_by, needle", [
    (None, "not traced", "not traced with Dynamo"),
    (CompileCheck(model_graphs=0, model_breaks=0, error="Unsupported: no fake kernel"),
     "dynamo trace", "Dynamo could not trace one forward on the meta device (Unsupported"),
])
def test_no_clean_trace_no_proposal(check, decided_by, needle):
    p = plan(GPT_SMALL, H100, Goal(global_batch=256), compile_check=check)
    assert not p.chosen.strategy.compile and p.compile.decided_by == decided_by
    assert needle in p.compile.reason


def test_a_gpu_too_old_for_triton_is_not_proposed_compile():
    old = dataclasses.replace(H100, accelerator=dataclasses.replace(
        H100.accelerator, name="P100", compute_capability=(6, 0)))
    p = plan(GPT_SMALL, old, Goal(global_batch=256), compile_check=CLEAN)
    assert not p.chosen.strategy.compile and p.compile.decided_by == "gpu too old"


def test_a_gain_within_the_models_accuracy_is_not_worth_compiling():
    # next to no saved activations: nothing memory-bound for compile to fuse
    lean = dataclasses.replace(GPT_SMALL, activation_bytes_per_sample=1.0)
    # bf16: float8's casts are memory-bound work compile would fuse
    p = plan(lean, H100, Goal(global_batch=256), compile_check=CLEAN, overrides=Overrides(float8="none"))
    assert not p.chosen.strategy.compile and p.compile.graph_breaks == 0
    assert f"a gain under {MIN_COMPILE_GAIN:.0%}" in p.compile.reason


def test_cpu_plans_never_propose_compile_and_keep_their_step_times():
    cpu = load_topology("cpu-local").with_shape(num_nodes=1, devices_per_node=2)
    before = plan(TOY, cpu, Goal())
    after = plan(TOY, cpu, Goal(), compile_check=CLEAN)
    assert after.chosen == before.chosen and after.rejected == before.rejected
    assert not after.chosen.strategy.compile
    assert after.compile.decided_by == "cpu" and CPU_REASON in after.reasons
    assert CPU_REASON.startswith("compile: not proposed on CPU: ")
    forced = plan(TOY, cpu, Goal(), overrides=Overrides(compile=True))
    assert forced.chosen.strategy.compile and forced.compile.compiled_step_time_s is None
    assert forced.chosen.time == before.chosen.time  # eager speed: compile not modelled on CPU


# --- `dlaunch run` follows it -------------------------------------------------------------------
def test_run_follows_the_plans_compile_unless_the_user_decided():
    p = plan(GPT_SMALL, H100, Goal(), compile_check=CLEAN)
    planned = Planned(plan=p, profile=GPT_SMALL, topology=H100)
    request = RunRequest(workload=GPT, device="cuda", gpus=8)
    assert request.compile is None  # nobody decided
    done = request.with_plan(planned)
    assert done.compile is True and "+ torch.compile" in done.plan_note
    assert done.launch_spec(run_id="r", run_dir="/RUN").compile is True
    for given in (False, True):
        kept = dataclasses.replace(request, compile=given).with_plan(planned)
        assert kept.compile is given and kept.launch_spec(run_id="r", run_dir="/RUN").compile is given
    # nothing planned (a plain script, a SLURM partition without a topology): eager
    assert RunRequest(workload=GPT).launch_spec(run_id="r", run_dir="/RUN").compile is False


def test_run_on_a_gpu_partition_compiles_unless_no_compile(dlaunch, tmp_path):
    args = ("run", GPT, "--slurm", "--nodes", "1", "--gpus-per-node", "8", "--topology",
            "topologies/h100-sxm-8x.yaml", "--dry-run", "--run-dir", str(tmp_path / "run"))
    # rendered where SLURM's commands are not (this host's sinfo would describe its CPU
    # partition): the partition's device is then --gpus-per-node's
    no_slurm = {"PATH": str(Path(sys.executable).parent)}
    done = dlaunch(*args, "--", "--size", "small", env=no_slurm)
    assert done.code == 0, done.err
    assert "dlaunch: plan: DDP bf16 + torch.compile" in done.err
    eager = dlaunch(*args, "--no-compile", "--", "--size", "small", env=no_slurm)
    assert eager.code == 0, eager.err
    assert "dlaunch: plan: " in eager.err and "torch.compile" not in eager.err
    assert_one_line_error(dlaunch(*args, "--no-compile", "--compile-strict"),
                          "--no-compile contradicts --compile-strict")

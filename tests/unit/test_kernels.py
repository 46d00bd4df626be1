"""Kernels as plan inputs (launcher.plan.kernels): the attention, loss and norm kernels the plan
prices come from the flags ("given"), the workload's KERNELS table ("declared"), what the
meta-device profile sees the model call ("detected", by name) or the default, and plan.json
and the text plan say which."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest

from launcher.cli.main import build_parser
from launcher.cli.options import BUILDS, load
from launcher.errors import PlanError, WorkloadError
from launcher.hardware.topology import load_topology
from launcher.plan.activations import activation_bytes
from launcher.plan.candidates import profile_for_goal
from launcher.plan.cost import _recompute, forward_pass
from launcher.plan.kernels import detected, kernel_of, with_kernels
from launcher.plan.profile import profile_workload, profiled_workload
from launcher.plan.search import plan
from launcher.plan.types import Overrides, PricedKernel
from launcher.request import RunRequest, follow_plan
from launcher.specs import Goal, Strategy
from launcher.workload import load_workload

from tests.helpers import WORKLOADS, assert_one_line_error

GPT = str(WORKLOADS / "gpt.py")
H100 = "h100-sxm-8x"
# a tiny language model; `extra` replaces its norm, attention, loss or declares KERNELS
LM = '''
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, HEADS, SEQ = 64, 16, 2, 8
SAMPLE_UNITS = "tokens"
Norm = nn.LayerNorm
loss = F.cross_entropy


def attend(q, k, v):  # q, k, v: batch, sequence, heads, head dim (flash-attn's layout)
    t = [x.transpose(1, 2) for x in (q, k, v)]
    return F.scaled_dot_product_attention(*t, is_causal=True).transpose(1, 2)

{extra}

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = Norm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).view(x.shape[0], SEQ, 3, HEADS, DIM // HEADS).unbind(2)
        return x + attend(q, k, v).reshape(x.shape)


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block() for _ in range(4)])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def build_model(cfg):
    return LM()


def make_dataset(cfg, n):
    return [torch.arange(i, i + SEQ + 1) % VOCAB for i in range(n)]


def loss_fn(model, batch):
    return loss(model(batch[:, :-1]).reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


def blocks(model):
    return list(model.blocks)


def units_per_sample(cfg):
    return SEQ
'''
# flash-attn's op as the package registers it (torch.library, with a fake for the meta device),
# called from an autograd Function of the workload's own: only the op's name says flash-attn
FLASH = '''
if not hasattr(torch.ops.flash_attn, "_flash_attn_forward"):
    @torch.library.custom_op("flash_attn::_flash_attn_forward", mutates_args=())
    def _fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(q)

    _fwd.register_fake(lambda q, k, v: torch.empty_like(q))


class Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        return torch.ops.flash_attn._flash_attn_forward(q, k, v)

    @staticmethod
    def backward(ctx, g):
        return g, g, g


attend = Attention.apply
'''
# Liger's fused norm and loss, faked by name (the package is not installed here): a module class
# named LigerRMSNorm, and the loss as an autograd Function named LigerCrossEntropyFunction
LIGER = '''
class LigerRMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class LigerCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target):
        ctx.save_for_backward(logits)
        return F.cross_entropy(logits, target)

    @staticmethod
    def backward(ctx, g):
        (logits,) = ctx.saved_tensors
        return torch.zeros_like(logits) * g, None


Norm = LigerRMSNorm
loss = LigerCrossEntropyFunction.apply
'''


# attention written out (Hugging Face's "eager"), with a softmax over something else beside it (a router's)
EAGER = '''
def attend(q, k, v):
    q, k, v = [x.transpose(1, 2) for x in (q, k, v)]
    F.softmax(q.sum(-1), dim=-1)  # (batch, heads, sequence): no scores
    return ((q @ k.transpose(-2, -1)).softmax(dim=-1) @ v).transpose(1, 2)
'''
# ... as transformers writes it: the softmax into fp32, cast back
UPCAST = '''
def attend(q, k, v):
    q, k, v = [x.transpose(1, 2) for x in (q, k, v)]
    return (F.softmax(q @ k.transpose(-2, -1), dim=-1, dtype=torch.float32).to(q.dtype) @ v).transpose(1, 2)
'''
# torch's multi-head attention (nn.MultiheadAttention's functional form), its weights asked for or not
MHA = '''
def attend(q, k, v):
    x = q.reshape(q.shape[0], SEQ, DIM).transpose(0, 1)  # (sequence, batch, width)
    w, b = torch.ones(3 * DIM, DIM, device=x.device), torch.zeros(3 * DIM, device=x.device)
    out, _ = F.multi_head_attention_forward(x, x, x, DIM, HEADS, w, b, None, None, False, 0.0, w[:DIM], b[:DIM],
                                            need_weights=NEED)
    return out.transpose(0, 1).reshape(q.shape)
'''
# SDPA beside a square batched matmul that is no attention (token mixing), and keyword-only calls
MIXING = '''
_sdpa = attend


def attend(q, k, v):
    mix = torch.ones(q.shape[0], SEQ, SEQ, device=q.device)
    q = torch.matmul(input=mix, other=q.reshape(q.shape[0], SEQ, -1)).view(q.shape)
    torch.softmax(input=q.sum(-1), dim=-1)
    return _sdpa(q, k, v)
'''
ROUTER = '''
_sdpa = attend


def attend(q, k, v):
    torch.softmax(q.sum(-1), dim=-1)  # a router's softmax beside SDPA
    return _sdpa(q, k, v)
'''


def lm(tmp_path: Path, extra: str = "", name: str = "lm.py") -> Path:
    path = tmp_path / name
    path.write_text(LM.format(extra=textwrap.dedent(extra)))
    return path


def kernels_of(plan_dict: dict) -> dict[str, tuple[str, str]]:
    return {role: (k["kernel"], k["source"]) for role, k in plan_dict["kernels"].items()}


@pytest.mark.parametrize("name, found", [
    ("torch.nn.functional.scaled_dot_product_attention", ("attention", "sdpa")),
    ("torch.nn.functional.softmax", ("attention", "eager")),  # recorded only over a square of scores
    ("flash_attn::_flash_attn_forward", ("attention", "fa2")),
    ("flash_attn.flash_attn_interface.FlashAttnFunc", ("attention", "fa2")),
    ("flash_attn.flash_attn_triton.FlashAttnFunc", ("attention", "triton-fa")),
    ("torch.nn.functional.cross_entropy", ("loss", "eager")),
    ("liger_kernel.ops.cross_entropy.LigerCrossEntropyFunction", ("loss", "fused")),
    ("flash_attn.losses.cross_entropy.CrossEntropyLoss", ("loss", "fused")),
    ("torch.nn.modules.loss.CrossEntropyLoss", ("loss", "eager")),
    ("liger_kernel.transformers.rms_norm.LigerRMSNorm", ("norm", "low-precision")),
    ("apex.normalization.fused_layer_norm.FusedLayerNorm", ("norm", "low-precision")),
    ("llmfoundry.models.layers.norm.LPLayerNorm", ("norm", "low-precision")),
    ("torch.nn.modules.normalization.RMSNorm", ("norm", "eager")),
    ("transformers.models.llama.modeling_llama.LlamaRMSNorm", ("norm", "eager")),
    ("torch.nn.modules.batchnorm.BatchNorm2d", None),
    ("xformers.ops.fmha.MemoryEfficientAttentionFlashAttentionOp", None),  # no kernel priced as it
    ("torch.nn.modules.linear.Linear", None),
])
def test_a_name_stands_for_the_kernel_it_is(name, found):
    assert kernel_of(name) == found


def test_a_fused_kernel_wins_over_the_default_one_seen_beside_it():
    names = ["torch.nn.functional.cross_entropy", "liger_kernel.ops.cross_entropy.LigerCrossEntropyFunction",
             "torch.nn.functional.scaled_dot_product_attention", "torch.nn.modules.linear.Linear"]
    assert detected(names) == {"loss": "fused", "attention": "sdpa"}
    # a softmax of scores beside SDPA or flash-attn is a side path (weights kept aside): the kernel is theirs
    softmax = "torch.nn.functional.softmax"
    assert detected([softmax, *names]) == {"loss": "fused", "attention": "sdpa"}
    assert detected([softmax, "flash_attn::_flash_attn_forward"]) == {"attention": "fa2"}
    assert detected([softmax]) == {"attention": "eager"}


def test_attention_written_out_is_detected_by_its_softmax_of_scores(tmp_path):
    eager = profiled_workload(load_workload(lm(tmp_path, EAGER, name="eager.py")))
    assert eager.profile.attention_kernel == "eager" and eager.kernel_sources["attention"] == "detected"
    router = profiled_workload(load_workload(lm(tmp_path, ROUTER, name="router.py")))
    assert router.profile.attention_kernel == "sdpa"  # a softmax over no scores is no attention
    # batch x heads x SEQ x SEQ fp32 scores per block; a softmax into fp32 keeps them and a cast back
    # under any low precision (6 B a score), a plain one as its regime runs it (FSDP's bf16: 2 B)
    upcast = profiled_workload(load_workload(lm(tmp_path, UPCAST, name="upcast.py"))).profile
    scores = 4 * 2 * 8 * 8 * 4  # the LM's 4 blocks, HEADS, SEQ
    assert eager.profile.attention_scores_bytes_per_sample == upcast.attention_scores_bytes_per_sample == scores
    assert eager.profile.attention_scores_upcast_bytes_per_sample == 0
    assert upcast.attention_scores_upcast_bytes_per_sample == scores
    fsdp = Strategy(kind="fsdp_full", precision="bf16")
    saved = upcast.activation_bytes_per_sample
    assert activation_bytes(upcast, fsdp, 1) == pytest.approx((saved - scores) * 0.5 + scores * 1.5)
    assert activation_bytes(eager.profile, fsdp, 1) == pytest.approx(eager.profile.activation_bytes_per_sample * 0.5)


def test_multi_head_attention_is_written_out_when_its_weights_are_asked_for(tmp_path):
    for need, kernel in ((True, "eager"), (False, "sdpa")):
        got = profiled_workload(load_workload(lm(tmp_path, f"NEED = {need}\n{MHA}", name=f"mha{need}.py"))).profile
        assert got.attention_kernel == kernel and got.attention_flops_fwd_per_sample == 4 * 8 * 8 * 16 * 4
        assert got.attention_scores_bytes_per_sample == (4 * 2 * 8 * 8 * 4 if need else 0)


def test_a_square_matmul_beside_sdpa_is_no_attention_and_keyword_calls_are_seen(tmp_path):
    sdpa = profile_workload(load_workload(lm(tmp_path)))
    mixing = profiled_workload(load_workload(lm(tmp_path, MIXING, name="mixing.py"))).profile
    assert mixing.attention_kernel == "sdpa" and mixing.attention_scores_bytes_per_sample == 0
    assert mixing.attention_flops_fwd_per_sample == sdpa.attention_flops_fwd_per_sample
    assert mixing.flops_fwd_per_sample > sdpa.flops_fwd_per_sample  # the mixing matmul, priced as a matmul


def test_a_kernel_given_against_the_profiles_holds_its_own_scores(tmp_path):
    sdpa = profile_workload(load_workload(lm(tmp_path)))
    eager = profile_workload(load_workload(lm(tmp_path, EAGER, name="eager.py")))
    as_eager = with_kernels(sdpa, {"attention": PricedKernel(kernel="eager", source="given")})
    scores = sdpa.attention_flops_fwd_per_sample / 128  # fp32 bytes of 4 x batch x heads x s x s x head dim FLOPs
    assert as_eager.attention_scores_bytes_per_sample == pytest.approx(scores)
    assert as_eager.activation_bytes_per_sample == pytest.approx(sdpa.activation_bytes_per_sample + scores)
    as_flash = with_kernels(eager, {"attention": PricedKernel(kernel="fa2", source="given")})
    assert as_flash.attention_scores_bytes_per_sample == 0
    assert as_flash.activation_bytes_per_sample == pytest.approx(
        eager.activation_bytes_per_sample - eager.attention_scores_bytes_per_sample)
    # at twice the tokens, written out attention's scores are four times the bytes, the rest twice
    longer = profile_for_goal(eager, Goal(seq_len=16))
    assert longer.attention_scores_bytes_per_sample == 4 * eager.attention_scores_bytes_per_sample
    assert longer.activation_bytes_per_sample == pytest.approx(
        2 * eager.activation_bytes_per_sample + 2 * eager.attention_scores_bytes_per_sample)
    # selective checkpointing keeps no bmm or softmax output: written out, attention is recomputed
    selective = Strategy(kind="fsdp_full", precision="bf16", checkpointing="selective")
    assert _recompute(selective, eager, 1.0, 1.0, 1.0) > _recompute(selective, sdpa, 1.0, 1.0, 1.0)


@pytest.mark.parametrize("attention, kernel", [("sdpa", "sdpa"), ("eager", "eager")])
def test_transformers_attention_written_out_is_detected_with_its_softmax_into_fp32(attention, kernel):
    profile = profiled_workload(load_workload(WORKLOADS / "hf_causal_lm.py", ["--attention", attention])).profile
    assert profile.attention_kernel == kernel and profile.attention_flops_fwd_per_sample > 0
    assert profile.attention_scores_upcast_bytes_per_sample == profile.attention_scores_bytes_per_sample
    assert (profile.attention_scores_bytes_per_sample > 0) == (attention == "eager")


def test_attention_written_out_holds_its_scores_and_costs_what_flash_attention_saves_against_it():
    # gpt.py's xl at 2k tokens (16 heads of 128), two blocks, attention by SDPA and written out
    layers, heads, seq = 2, 16, 2048
    a100 = load_topology("a100-sxm-8x").accelerator
    profiles, passes = {}, {}
    for kernel in ("sdpa", "eager"):
        args = ["--size", "xl", "--layers", str(layers), "--attention", kernel]
        profiles[kernel] = profiled_workload(load_workload(GPT, args)).profile
        assert profiles[kernel].attention_kernel == kernel
        passes[kernel] = forward_pass(profiles[kernel], Strategy(kind="ddp", precision="bf16"), 1, a100)
    # the probabilities (fp32 on the meta device) saved for backward, where flash saves none
    held = profiles["eager"].activation_bytes_per_sample - profiles["sdpa"].activation_bytes_per_sample
    assert held > 0.9 * layers * heads * seq * seq * 4
    assert profiles["eager"].attention_scores_bytes_per_sample == layers * heads * seq * seq * 4
    # its two matmuls counted as SDPA's FLOPs are (q @ k^T, scores @ v)
    assert profiles["eager"].attention_flops_fwd_per_sample == profiles["sdpa"].attention_flops_fwd_per_sample > 0
    # autocast: CUDA's runs softmax in fp32 (kept for its backward, and the next matmul's bf16 cast of
    # it: 6 B a score), CPU's in bf16 (2 B)
    bf16 = Strategy(kind="ddp", precision="bf16")
    on_cuda, on_cpu = (activation_bytes(profiles["eager"], bf16, 1, device=d) for d in ("cuda", "cpu"))
    assert on_cuda - on_cpu == pytest.approx(profiles["eager"].attention_scores_bytes_per_sample)
    # FlashAttention-2's paper: 3-10x faster than PyTorch's standard attention on an A100: attention's
    # matmuls and the memory-bound work over the saved scores, forward and backward
    sdpa, eager = passes["sdpa"], passes["eager"]
    assert eager.gemm_s == pytest.approx(sdpa.gemm_s)  # the blocks' linears are the same
    flash_s = sdpa.attention_s + sdpa.attention_bwd_s
    written_out_s = eager.attention_s + eager.attention_bwd_s + 3 * (eager.memory_s - sdpa.memory_s)
    assert 3 < written_out_s / flash_s < 10
    assert eager.attention_bwd_s == pytest.approx(2 * eager.attention_s)


def test_a_model_calling_sdpa_is_detected_and_one_calling_nothing_is_the_default(tmp_path):
    got = profiled_workload(load_workload(lm(tmp_path)))
    assert got.kernel_sources == {"attention": "detected", "loss": "detected", "norm": "detected"}
    p = got.profile
    assert (p.attention_kernel, p.loss_kernel, p.norm_kernel) == ("sdpa", "eager", "eager")
    mlp = profiled_workload(load_workload(WORKLOADS / "mlp.py"))
    assert "attention" not in mlp.kernel_sources  # no attention: the default, said so
    planned = plan(mlp.profile, load_topology(H100), Goal(), kernel_sources=mlp.kernel_sources)
    assert planned.kernels["attention"].source == "default"


def test_flash_attn_ops_are_detected_and_their_flops_counted_as_sdpas(tmp_path):
    sdpa = profile_workload(load_workload(lm(tmp_path)))
    got = profiled_workload(load_workload(lm(tmp_path, FLASH, name="flash.py")))
    assert got.profile.attention_kernel == "fa2" and got.kernel_sources["attention"] == "detected"
    assert got.profile.attention_flops_fwd_per_sample == sdpa.attention_flops_fwd_per_sample > 0
    assert got.profile.flops_fwd_per_sample == sdpa.flops_fwd_per_sample


def test_fused_losses_and_norms_are_detected_by_name(tmp_path):
    got = profiled_workload(load_workload(lm(tmp_path, LIGER)))
    assert (got.profile.loss_kernel, got.profile.norm_kernel) == ("fused", "low-precision")
    assert got.kernel_sources == {"attention": "detected", "loss": "detected", "norm": "detected"}


def test_a_workloads_kernels_table_is_declared_and_a_flag_beats_it(tmp_path):
    got = profiled_workload(load_workload(lm(tmp_path, 'KERNELS = {"attention": "fa2", "loss": "fused"}')))
    assert got.kernel_sources == {"attention": "declared", "loss": "declared", "norm": "detected"}
    topo = load_topology(H100)
    declared = plan(got.profile, topo, Goal(), kernel_sources=got.kernel_sources)
    assert {r: (k.kernel, k.source) for r, k in declared.kernels.items()} == {
        "attention": ("fa2", "declared"), "loss": ("fused", "declared"), "norm": ("eager", "detected")}
    given = plan(got.profile, topo, Goal(), overrides=Overrides(attention_kernel="triton-fa"),
                 kernel_sources=got.kernel_sources)
    assert (given.kernels["attention"].kernel, given.kernels["attention"].source) == ("triton-fa", "given")


@pytest.mark.parametrize("table, needle", [
    ('{"attention": "xformers"}', "unknown attention kernel 'xformers'; dlaunch prices sdpa, fa2, triton-fa"),
    ('{"mlp": "fused"}', "KERNELS has 'mlp'; its keys are attention, loss, norm"),
    ('["fa2"]', "KERNELS must be a dict of role -> kernel name"),
])
def test_a_bad_kernels_table_is_one_line(tmp_path, table, needle):
    with pytest.raises(WorkloadError) as e:
        profile_workload(load_workload(lm(tmp_path, f"KERNELS = {table}")))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_an_unknown_kernel_override_is_one_line():
    with pytest.raises(PlanError, match="unknown --loss-kernel 'liger'; use one of eager, fused"):
        Overrides(loss_kernel="liger")


def test_a_fused_loss_is_priced_apart_for_a_language_model():
    profile = profile_workload(load_workload(GPT, ["--seq-len", "1024"]))
    # micro-batch 64: the GPU's work, not the host's launches, sets this small model's step
    fixed = dict(strategy="ddp", precision="bf16", micro_batch=64, compile=False)
    topo, goal = load_topology(H100), Goal(global_batch=512)
    eager = plan(profile, topo, goal, overrides=Overrides(**fixed))
    fused = plan(profile, topo, goal, overrides=Overrides(**fixed, loss_kernel="fused"))
    assert fused.kernels["loss"].kernel == "fused" and eager.kernels["loss"].kernel == "eager"
    # fewer passes over the logits: the memory-bound work and so the step shrink
    assert fused.chosen.time.step_time_s < 0.99 * eager.chosen.time.step_time_s
    assert fused.chosen.strategy == eager.chosen.strategy  # the kernel is priced, not forced
    assert not any("forced by overrides" in r and "kernel" in r for r in fused.reasons)


@pytest.mark.parametrize("command", ["run", "lab", "plan", "scale", "tune"])
def test_every_command_that_plans_takes_the_kernel_flags(command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = [command, "w.py", *(["--gpus", "1,2"] if command == "scale" else []),
            "--attention-kernel", "fa2", "--loss-kernel", "fused", "--norm-kernel", "low-precision"]
    settings = load(BUILDS[command], build_parser().parse_args(argv)).settings
    assert (settings.attention_kernel, settings.loss_kernel, settings.norm_kernel) == (
        "fa2", "fused", "low-precision")


def test_a_runs_plan_prices_the_given_kernel():
    request = RunRequest(workload=GPT, device="cuda", gpus=8, strategy="ddp", precision="bf16",
                         micro_batch=4, compile=False, loss_kernel="fused")
    planned = follow_plan(request, topology=H100).planned
    assert planned is not None
    assert (planned.plan.kernels["loss"].kernel, planned.plan.kernels["loss"].source) == ("fused", "given")
    assert planned.profile.loss_kernel == "fused"  # plan.json's profile: what was priced
    spec = request.launch_spec(run_id="r", run_dir="/tmp/r")
    assert json.loads(json.dumps(spec.to_dict()))["loss_kernel"] == "fused"


def test_plan_json_and_text_say_each_kernel_and_its_source(dlaunch):
    done = dlaunch("plan", GPT, "--topology", H100, "--loss-kernel", "fused", "--json")
    assert done.code == 0, done.err
    data = done.json()
    assert kernels_of(data["plan"]) == {"attention": ("sdpa", "detected"), "loss": ("fused", "given"),
                                        "norm": ("eager", "detected")}
    assert data["profile"]["loss_kernel"] == "fused"
    text = dlaunch("plan", GPT, "--topology", H100, "--norm-kernel", "low-precision")
    assert text.code == 0, text.err
    assert ("  kernels      attention sdpa (detected), loss eager (detected), "
            "norm low-precision (given)") in text.out.splitlines()


def test_an_unknown_kernel_flag_or_table_entry_is_exit_2_and_one_line(dlaunch, tmp_path):
    assert_one_line_error(dlaunch("plan", GPT, "--attention-kernel", "xformers"),
                          "--attention-kernel", "invalid choice", "xformers", "sdpa")
    assert_one_line_error(dlaunch("run", GPT, "--loss-kernel", "liger"), "--loss-kernel", "liger")
    bad = lm(tmp_path, 'KERNELS = {"norm": "apex"}')
    assert_one_line_error(dlaunch("plan", str(bad), "--topology", H100),
                          "unknown norm kernel 'apex'; dlaunch prices eager, low-precision")


def test_an_assumed_kernel_widens_the_interval_by_what_the_others_would_cost(tmp_path):
    # the residuals behind the interval come from runs whose kernels were known: a kernel the
    # plan only assumed widens it to cover the other kernels it prices, a known one does not
    got = profiled_workload(load_workload(lm(tmp_path)))
    topo, goal = load_topology(H100), Goal(seq_len=8192)
    known = plan(got.profile, topo, goal, kernel_sources=got.kernel_sources).step_interval
    assumed = plan(got.profile, topo, goal, kernel_sources={"loss": "detected", "norm": "detected"}).step_interval
    assert known is not None and assumed is not None and known.step_time_s == assumed.step_time_s
    assert "assumed" not in known.basis
    note = re.search(r"widened for what was assumed: attention sdpa assumed \(fa2 ([\d.]+)x, triton-fa ([\d.]+)x\)",
                     assumed.basis)
    assert note, assumed.basis
    # each end moves by the alternatives' extreme ratio to the priced kernel (capped at 1: an
    # end no alternative passes stays where the residuals put it)
    ratios = [float(note.group(1)), float(note.group(2))]
    assert max(ratios) > 1.05  # on an H100 at 8k tokens the kernel matters
    assert assumed.low_s / known.low_s == pytest.approx(min(1.0, *ratios), abs=0.006)
    assert assumed.high_s / known.high_s == pytest.approx(max(1.0, *ratios), abs=0.006)

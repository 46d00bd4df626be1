"""workloads/hf_causal_lm.py: a Hugging Face causal LM built from a config.json (never
downloaded) trains under FSDP (one unit per decoder layer) and under DDP with bf16 and
checkpointing on a token file, plans a Llama-2-7B config on the meta device, and without
transformers installed says how to install it in one line.

Sizes: tests/data/llama-tiny is a 2-layer Llama of 107k parameters (hidden 64, vocab 256: the
byte-level tokens of scripts/make_tokens.py fit it), so a step takes a fraction of a second on
one CPU thread per rank.
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from launcher.workload import load_workload

from tests.helpers import (
    DATA,
    REPO,
    WORKLOADS,
    Done,
    assert_one_line_error,
    log_tails,
    rank_losses,
    rank_records,
    run_result,
)

HF = str(WORKLOADS / "hf_causal_lm.py")
TINY = str(DATA / "llama-tiny")
LLAMA_7B = str(DATA / "llama-7b" / "config.json")
TINY_LAYERS = json.loads((DATA / "llama-tiny" / "config.json").read_text())["num_hidden_layers"]
CPU = {"OMP_NUM_THREADS": "1"}


def _finite_and_learning(losses: list[float]) -> None:
    assert losses and all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0], losses  # the synthetic sequences and README bytes are learnable


def _fsdp_units(trace: Path) -> set[str]:
    """The modules FSDP ran as units of their own in a profiled step: FSDP2 names each unit's
    pre-forward `FSDP::pre_forward (<module path>)` in the trace (the root's has no path)."""
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    prefix = "FSDP::pre_forward ("
    return {e["name"][len(prefix):-1] for e in events if str(e.get("name", "")).startswith(prefix)}


@pytest.mark.distributed
def test_fsdp_trains_a_llama_config_with_one_unit_per_decoder_layer(dlaunch, tmp_path):
    pytest.importorskip("transformers")
    run = tmp_path / "run"
    done = dlaunch("run", HF, "--gpus", "2", "--strategy", "fsdp_full", "--steps", "8", "--profile",
                   "--hang-timeout-s", "120", "--run-dir", str(run), "--", "--config", TINY, env=CPU)
    assert done.code == 0, done.out + done.err + log_tails(run)
    result = run_result(run)
    assert result["status"] == "ok" and result["sample_units"] == "tokens"
    for rank in (0, 1):
        _finite_and_learning(rank_losses(run, rank))
    wrap = next(r for r in rank_records(run) if r["kind"] == "wrap")
    assert wrap["strategy"] == "fsdp_full" and wrap["mesh_shape"] == [2]
    # the rank records do not list the units; the profiler's trace of a wrapped step does
    units = _fsdp_units(run / "trace-rank0.json")
    assert units == {f"model.layers.{i}" for i in range(TINY_LAYERS)}, units
    plan = json.loads((run / "plan.json").read_text())
    assert plan["profile"]["num_blocks"] == TINY_LAYERS
    assert plan["profile"]["units_per_sample"] == 256  # the config's context length


@pytest.mark.distributed
def test_ddp_bf16_with_checkpointing_trains_on_a_token_file(dlaunch, tmp_path):
    pytest.importorskip("transformers")
    tokens = tmp_path / "train.bin"
    made = subprocess.run([sys.executable, str(REPO / "scripts" / "make_tokens.py"), str(REPO / "README.md"),
                           "-o", str(tokens)], capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    run = tmp_path / "run"
    done = dlaunch("run", HF, "--gpus", "2", "--strategy", "ddp", "--precision", "bf16", "--checkpointing", "full",
                   "--steps", "8", "--run-dir", str(run), "--",
                   "--config", TINY, "--tokens", str(tokens), "--seq-len", "128", env=CPU)
    assert done.code == 0, done.out + done.err + log_tails(run)
    assert run_result(run)["status"] == "ok"
    launched = json.loads((run / "launch.json").read_text())
    assert (launched["strategy"], launched["precision"], launched["checkpointing"]) == ("ddp", "bf16", "full")
    _finite_and_learning(rank_losses(run))


def test_a_7b_llama_config_plans_on_the_meta_device(dlaunch):
    pytest.importorskip("transformers")
    done = dlaunch("plan", HF, "--topology", str(REPO / "topologies" / "h100-sxm-8x.yaml"), "--json",
                   "--", "--config", LLAMA_7B)
    assert done.code == 0, done.err
    profile = done.json()["profile"]
    assert profile["num_params"] == 6_738_415_616  # Llama 2 7B, exactly
    assert profile["bytes_by_dtype"] == {"float32": 4 * 6_738_415_616}  # not the config's float16
    assert profile["num_blocks"] == 32 and profile["units_per_sample"] == 4096
    # on one GPU only offload fits; the checkpointing reason weighs linear FSDP units, which take no selective
    # checkpointing, beside the chosen plan's own modes (it once built them in the chosen mode and failed)
    one = dlaunch("plan", HF, "--topology", str(REPO / "topologies" / "h100-sxm-8x.yaml"), "--gpus", "1", "--json",
                  "--", "--config", LLAMA_7B)
    assert one.code == 0, one.err
    plan = one.json()["plan"]
    assert plan["chosen"]["strategy"]["offload"]
    assert any(r.startswith("activation checkpointing") for r in plan["reasons"])


def test_named_shapes_find_their_decoder_layers():
    pytest.importorskip("transformers")
    import torch

    for name, layer in (("tiny-llama", "LlamaDecoderLayer"), ("tiny-gpt2", "GPT2Block")):
        w = load_workload(HF, ["--config", name])
        with torch.device("meta"):
            model = w.build_model()
        blocks = w.blocks(model)
        assert [type(b).__name__ for b in blocks] == [layer] * 4, name
        assert w.units_per_sample == 128 and len(w.make_dataset(3)) == 3


def test_a_config_that_is_not_a_local_file_is_one_line(dlaunch, tmp_path):
    pytest.importorskip("transformers")
    done = dlaunch("plan", HF, "--topology", str(REPO / "topologies" / "h100-sxm-8x.yaml"),
                   "--", "--config", "meta-llama/Llama-2-7b-hf",
                   env={"DLAUNCH_CACHE_DIR": str(tmp_path / "cache")})
    assert_one_line_error(done, "--config 'meta-llama/Llama-2-7b-hf'", "downloads nothing")


# imports of transformers fail in this interpreter as if it were not installed, then dlaunch runs
_WITHOUT_TRANSFORMERS = """
import sys
class NoTransformers:
    def find_spec(self, name, path=None, target=None):
        if name == "transformers" or name.startswith("transformers."):
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, NoTransformers())
from launcher.cli.main import entry
sys.argv = ["dlaunch", *sys.argv[1:]]
entry()
"""


def test_without_transformers_the_error_says_how_to_install_it(tmp_path):
    # a cache of its own: a cached profile would not import the workload at all
    env = {**os.environ, "DLAUNCH_CACHE_DIR": str(tmp_path / "cache"), "TMPDIR": str(tmp_path)}
    env.pop("DLAUNCH_DEBUG", None)
    proc = subprocess.run([sys.executable, "-c", _WITHOUT_TRANSFORMERS, "plan", HF,
                           "--topology", str(REPO / "topologies" / "h100-sxm-8x.yaml"), "--", "--config", TINY],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert_one_line_error(Done(proc.returncode, proc.stdout, proc.stderr),
                          "workloads/hf_causal_lm.py needs transformers: pip install 'dlaunch[hf]'")


@pytest.mark.distributed
def test_an_accelerate_script_forms_one_group_of_2_cpu_processes(dlaunch, tmp_path):
    # a plain script: dlaunch launches it unchanged under torchrun, and tells Accelerate to form
    # its (gloo) group on CPU; without that each process would train alone
    done = dlaunch("run", str(DATA / "accelerate_train.py"), "--gpus", "2", "--run-dir", str(tmp_path / "run"),
                   env=CPU)
    assert done.code == 0, done.err[-3000:]
    for rank in (0, 1):
        assert f"[rank {rank}] accelerate: process {rank} of 2, group [0, 1], device cpu" in done.out, done.out
        assert f"[rank {rank}] accelerate: process {rank} weights equal across the group: True" in done.out
    assert run_result(tmp_path / "run")["world_size"] == 2


MIXTRAL = str(DATA / "mixtral-tiny")


@pytest.mark.distributed
def test_a_mixtral_config_plans_with_a_note_on_its_experts_and_runs(dlaunch, tmp_path):
    done = dlaunch("run", HF, "--gpus", "2", "--steps", "6", "--run-dir", str(tmp_path / "run"), "--",
                   "--config", MIXTRAL, "--seq-len", "32", env=CPU)
    assert done.code == 0, done.err[-3000:]
    losses = rank_losses(tmp_path / "run")
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    # the plan it followed profiled the experts through the stand-in, and says so
    note = json.loads((tmp_path / "run" / "plan.json").read_text())["profile"]["profile_note"]
    assert note.startswith("MoE (4 experts, top-2) profiled on the meta device with even routing"), note


@pytest.mark.distributed
@pytest.mark.parametrize(("config", "trains"), [("qwen2-moe-tiny", False), ("olmoe-tiny", False),
                                                ("deepseek-v3-tiny", True)])
def test_every_moe_family_plans_through_the_experts_stand_in(dlaunch, tmp_path, config, trains):
    # Qwen2-MoE and OLMoE count their experts in `num_experts`, DeepSeek-V3 in `n_routed_experts`
    # (with shared experts and dense first layers beside them): each plans through the stand-in;
    # DeepSeek-V3, the family with the most parts, also trains (Mixtral's run is the test above)
    args = ("--", "--config", str(DATA / config), "--seq-len", "32")
    if not trains:
        done = dlaunch("plan", HF, "--gpus", "2", "--json", *args, env=CPU)
        assert done.code == 0, done.err[-3000:]
        note = json.loads(done.out)["profile"]["profile_note"]
    else:
        done = dlaunch("run", HF, "--gpus", "2", "--steps", "5", "--no-calibrate", "--run-dir", str(tmp_path / "run"),
                       *args, env=CPU)
        assert done.code == 0, done.err[-3000:]
        losses = rank_losses(tmp_path / "run")
        assert len(losses) == 5 and all(math.isfinite(x) for x in losses)
        note = json.loads((tmp_path / "run" / "plan.json").read_text())["profile"]["profile_note"]
    assert note.startswith("MoE (4 experts, top-2) profiled on the meta device with even routing"), note


def test_a_gemma2_config_trains_past_its_window_with_transformers_own_masked_losses():
    """Gemma-2 alternates sliding-window and full layers and soft-caps its logits: at 4x its
    window, three training steps through the workload's attention (a band mask from shapes, the
    soft-cap's eager arithmetic) give the losses transformers' own eager attention gives with
    the masks it builds, from the same weights and batches."""
    workload = load_workload(HF, ["--config", str(DATA / "gemma2-tiny"), "--seq-len", "64"])
    torch.manual_seed(0)
    ours = workload.build_model()
    assert ours.config.sliding_window * 4 == 64
    theirs = copy.deepcopy(ours)
    theirs.set_attn_implementation("eager")
    data = workload.make_dataset(6)
    losses: dict[str, list[float]] = {"ours": [], "theirs": []}
    for name, model in (("ours", ours), ("theirs", theirs)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            batch = torch.utils.data.default_collate([data[2 * step], data[2 * step + 1]])
            loss = workload.loss_fn(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[name].append(float(loss))
    assert losses["ours"] == pytest.approx(losses["theirs"], rel=1e-5), losses
    # the window matters at this length: without it the first loss differs
    torch.manual_seed(0)
    fresh = workload.build_model()
    for module in fresh.modules():
        if getattr(module, "sliding_window", None):
            module.sliding_window = None
    with torch.no_grad():
        unmasked = float(workload.loss_fn(fresh, torch.utils.data.default_collate([data[0], data[1]])))
    assert abs(unmasked - losses["theirs"][0]) > 1e-3


def test_the_meta_experts_stand_in_computes_what_the_experts_do_when_routing_is_even():
    # the stand-in assigns pair p to expert p // share: with that routing it must give what the
    # experts compute by definition (the same matmuls: the same FLOPs and saved activations)
    workload = load_workload(HF, ["--config", MIXTRAL])
    model = workload.build_model()
    experts = next(m for m in model.modules() if type(m).__name__ == "MixtralExperts")
    tokens, top_k, n = 6, 2, experts.num_experts
    hidden = torch.randn(tokens, experts.hidden_dim, generator=torch.Generator().manual_seed(0))
    index = (torch.arange(tokens * top_k) // (tokens * top_k // n)).view(tokens, top_k)
    weights = torch.rand(tokens, top_k, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        stand_in = workload.module._balanced_experts(experts, hidden, index, weights)
        reference = _eager_experts(experts, hidden, index, weights)
    assert torch.allclose(stand_in, reference, atol=1e-5), (stand_in - reference).abs().max()


def _eager_experts(experts, hidden, index, weights):
    """Each token through each of its top-k experts, weighted and summed: the MoE's definition."""
    out = torch.zeros_like(hidden)
    for t in range(hidden.size(0)):
        for j in range(index.size(1)):
            e = int(index[t, j])
            gate, up = F.linear(hidden[t], experts.gate_up_proj[e]).chunk(2, dim=-1)
            out[t] += weights[t, j] * F.linear(experts.act_fn(gate) * up, experts.down_proj[e])
    return out

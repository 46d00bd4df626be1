"""A Hugging Face `transformers` causal language model (Llama, Mistral, Qwen, GPT-2, ...) as a
dlaunch workload: the model is built from its configuration only, never downloaded.

    dlaunch run workloads/hf_causal_lm.py --gpus 2 -- --config path/to/config.json
    dlaunch plan workloads/hf_causal_lm.py --topology topologies/h100-sxm-8x.yaml -- --config DIR

What it owns:
- the model: `--config` is a `config.json`, a folder holding one (a checkpoint's folder), or a
  named tiny shape (`tiny-llama`, `tiny-gpt2`, for trying dlaunch out); the architecture comes
  from the config's `model_type`, the weights are freshly initialised in fp32 (the harness owns
  precision, so a config's `torch_dtype` is ignored), the KV cache is off, and attention is
  SDPA, plainly causal: every sample is one whole sequence (no padding, no packing);
  `--attention eager` writes it out as transformers' own eager attention does (scores, a
  softmax in fp32 cast back, `@ v`), with the causal mask built from shapes;
- the data: synthetic learnable sequences (workloads/gpt.py's) by default, or `--tokens FILE`,
  a flat uint16 token file in workloads/tokens.py's format; `--seq-len` tokens per sample
  (default: the config's context length, at most 8192);
- the units: FSDP wraps, and activation checkpointing recomputes, each decoder layer, found from
  the model's own `_no_split_modules` (the classes transformers itself keeps whole when it shards)
  or else its largest layer list (`model.layers`, `transformer.h`);
- the loss: next-token cross-entropy over the logits, as gpt.py's.

Mixture-of-experts configs (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3: whatever the family calls its
routed experts, `_EXPERT_COUNTS`): they train with transformers' own experts kernel.
On the meta device that kernel cannot run (`torch._grouped_mm`'s meta function takes bf16 only;
the eager path's `nonzero` has a data-dependent shape), so `dlaunch plan` profiles the experts
through a stand-in registered here (`_balanced_experts`): every expert gets an equal share of
the tokens x top-k token-expert pairs, through batched matmuls of the same FLOPs and saved
activations. Real routing is uneven, and the busiest expert sets the step: the plan says how the
model was profiled.

`transformers` is an optional dependency (`pip install 'dlaunch[hf]'`) imported only here, and
only when a model or config is needed, so a missing package is one line, not a traceback.
The model builds and runs under `with torch.device("meta")`, so `dlaunch plan` profiles a 7B
config in seconds without memory. The profile cache is keyed by this file and its arguments,
not by the config file's content: after editing a config.json in place, give it a new path.
"""

from __future__ import annotations

import copy
import functools
import os
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from gpt import Sequences  # the neighbour's learnable synthetic tokens
from tokens import TokenWindows  # the neighbour's reader of a uint16 token file
from torch import nn

from launcher.errors import WorkloadError

DEFAULTS = {"config": "tiny-llama", "seq_len": 0, "tokens": "", "attention": "sdpa"}
SAMPLE_UNITS = "tokens"
# the name our attention function is registered under (no "sdpa" in it: transformers would then
# refuse families it has no SDPA path for, Gemma-2's soft-capping among them)
ATTENTION = "dlaunch_causal"
EAGER = "dlaunch_causal_eager"  # ... and its written-out form (`--attention eager`)
BALANCED_EXPERTS = "dlaunch_balanced"  # the meta-device stand-in for an MoE's experts kernel

INSTALL_HINT = "workloads/hf_causal_lm.py needs transformers: pip install 'dlaunch[hf]'"
# the longest default sequence: a config's context may be 128k tokens (Llama 3.1), which no one
# pre-trains at; 8192 is Llama 3's pre-training length. `--seq-len` sets any other.
MAX_DEFAULT_SEQ_LEN = 8192

# named shapes, built with AutoConfig.for_model: small enough to train on a laptop CPU
NAMED = {
    "tiny-llama": ("llama", {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
                             "num_key_value_heads": 2, "intermediate_size": 688, "vocab_size": 2048,
                             "max_position_embeddings": 128}),
    "tiny-gpt2": ("gpt2", {"n_embd": 256, "n_layer": 4, "n_head": 4, "vocab_size": 2048,
                           "n_positions": 128, "bos_token_id": 0, "eos_token_id": 0}),
}


def _transformers() -> Any:
    """The transformers package, or the one-line install hint (exit 2) when it is missing."""
    try:
        import transformers
    except ImportError:
        raise WorkloadError(INSTALL_HINT) from None
    return transformers


@functools.lru_cache(maxsize=8)
def _load_config(spec: str) -> Any:
    """The model's config from a named shape or a local config.json / folder, never the Hub."""
    transformers = _transformers()
    if spec in NAMED:
        model_type, fields = NAMED[spec]
        return transformers.AutoConfig.for_model(model_type, **fields)
    path = os.path.expanduser(spec)
    if not (os.path.isfile(path) or os.path.isfile(os.path.join(path, "config.json"))):
        # from_pretrained would take a missing path for a Hub name and download: refused here
        raise WorkloadError(f"--config {spec!r} is neither a named shape ({', '.join(NAMED)}) nor a "
                            "config.json or a folder holding one; dlaunch downloads nothing: save a "
                            "Hub model's config with AutoConfig.from_pretrained(name)"
                            ".save_pretrained(DIR) and give DIR")
    try:
        return transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:  # unreadable JSON, an unknown model_type
        raise WorkloadError(f"--config {spec!r}: transformers cannot read it: {e}") from None


def _config(cfg: SimpleNamespace) -> Any:
    # a copy: building changes fields (dtype, use_cache) and the cached one is shared
    return copy.deepcopy(_load_config(cfg.config))


def _context_length(config: Any) -> int | None:
    # GPT-2's n_positions is reachable under this name too (its config's attribute_map)
    return getattr(config, "max_position_embeddings", None)


def units_per_sample(cfg: SimpleNamespace) -> int:
    """Tokens per sequence: `--seq-len`, else the config's context length (at most 8192)."""
    # load_workload calls this first, outside its "raised on import" wrapping: a missing
    # package or a bad --config fails here as its own one line
    config = _load_config(cfg.config)
    limit = _context_length(config)
    if cfg.seq_len < 0:
        raise WorkloadError(f"--seq-len {cfg.seq_len}: give a positive number of tokens")
    if cfg.seq_len and limit and cfg.seq_len > limit:
        # learned positions (GPT-2) have no embedding past it; rotary ones were not trained there
        raise WorkloadError(f"--seq-len {cfg.seq_len} is longer than the config's context of "
                            f"{limit} tokens (max_position_embeddings); raise that in the config")
    return cfg.seq_len or min(limit or 1024, MAX_DEFAULT_SEQ_LEN)  # 1024: GPT-2's, if none given


def _causal_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, *, eager: bool = False, **kwargs: Any) -> Any:
    """transformers' own SDPA attention, plainly causal (`is_causal=True`, no mask); a
    sliding-window layer (Gemma-2, Mistral) gets its band as a mask built from shapes alone, and
    soft-capped logits (Gemma-2), or every layer with `eager`, the arithmetic transformers' own
    eager attention does."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    if not window and not softcap and not eager:
        return sdpa_attention_forward(module, query, key, value, None, **kwargs)
    q_len, k_len = query.shape[-2], key.shape[-2]
    # key j is visible from query i when j <= i and, in a window, i - j < window (transformers'
    # sliding-window overlay)
    i = torch.arange(q_len, device=query.device).view(-1, 1) + (k_len - q_len)
    j = torch.arange(k_len, device=query.device).view(1, -1)
    hidden = (j > i) | (i - j >= window) if window else j > i
    mask = torch.zeros(q_len, k_len, dtype=query.dtype, device=query.device).masked_fill(
        hidden, torch.finfo(query.dtype).min)
    if not softcap and not eager:
        return sdpa_attention_forward(module, query, key, value, mask[None, None], **kwargs)
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * kwargs.get("scaling", query.shape[-1] ** -0.5)
    scores = (torch.tanh(scores / softcap) * softcap if softcap else scores) + mask
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = F.dropout(weights, p=kwargs.get("dropout", 0.0), training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def _balanced_experts(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                      top_k_weights: torch.Tensor) -> torch.Tensor:
    """An experts forward with no data-dependent shape, for the meta device: the S = tokens x
    top-k token-expert pairs split evenly over the experts (the last padded), each expert's
    share through its gate-up and down projections as one batched matmul. The FLOPs and saved
    activations are those of the grouped kernel under balanced routing."""
    tokens, hidden = hidden_states.shape
    top_k, experts = top_k_index.size(-1), self.num_experts
    pairs = tokens * top_k
    share = -(-pairs // experts)
    x = hidden_states.repeat_interleave(top_k, dim=0)
    x = F.pad(x, (0, 0, 0, experts * share - pairs)).view(experts, share, hidden)
    gate, up = torch.bmm(x, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)
    out = torch.bmm(self.act_fn(gate) * up, self.down_proj.transpose(1, 2))
    out = out.reshape(experts * share, hidden)[:pairs] * top_k_weights.reshape(-1, 1).to(out.dtype)
    return out.view(tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)


# what the MoE families call their routed experts per layer: Mixtral; Qwen2/3-MoE, OLMoE;
# DeepSeek-V3
_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")


def _moe_experts(config: Any) -> int:
    """The routed experts per layer of an MoE config, 0 for a dense one."""
    return next((int(n) for name in _EXPERT_COUNTS if (n := getattr(config, name, 0))), 0)


def build_model(cfg: SimpleNamespace) -> nn.Module:
    transformers = _transformers()
    config = _config(cfg)
    units_per_sample(cfg)  # checks --seq-len against the config
    config.use_cache = False  # training: no KV cache built in the forward (memory, meta-safety)
    # fp32 weights whatever the config says (transformers 5 builds at config.dtype, and a Hub
    # config says float16): the harness's precision plan casts, as for every workload
    config.dtype = torch.float32
    # Every sample is one whole sequence (no padding, no packing), so attention is plainly
    # causal. An attention function transformers has no mask builder for makes it build none:
    # its `sdpa` path checks the positions for packed sequences with a host sync each forward,
    # which fails on the meta device (`dlaunch plan`) and stalls a GPU's queue.
    if cfg.attention not in ("sdpa", "eager"):
        raise WorkloadError(f"--attention {cfg.attention!r}: sdpa or eager")
    transformers.AttentionInterface.register(ATTENTION, _causal_sdpa)
    transformers.AttentionInterface.register(EAGER, functools.partial(_causal_sdpa, eager=True))
    attention = EAGER if cfg.attention == "eager" else ATTENTION
    experts = _moe_experts(config)
    if not (experts and torch.get_default_device().type == "meta"):
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention)
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(BALANCED_EXPERTS, _balanced_experts)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention,
                                                          experts_implementation=BALANCED_EXPERTS)
    top_k = int(getattr(config, "num_experts_per_tok", 1) or 1)
    model.dlaunch_profile_note = (  # launcher.plan.profile.PROFILE_NOTE_ATTR
        f"MoE ({experts} experts, top-{top_k}) profiled on the meta device with even routing: each "
        f"expert takes 1/{experts} of the tokens x {top_k} pairs (transformers' grouped kernel has no "
        "meta form); uneven routing makes the busiest expert's share, and the step, larger")
    return model


def blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder layers: the outermost modules of the classes in `_no_split_modules`, else the
    ModuleList with the most parameters."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found: list[nn.Module] = []
    inside: set[int] = set()  # modules within a unit already found (a layer's own sub-blocks)
    for module in model.modules():
        if id(module) in inside:
            continue
        if type(module).__name__ in names:
            found.append(module)
            inside.update(id(m) for m in module.modules())
    if found:
        return found
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 1]
    if not lists:
        return []
    return list(max(lists, key=lambda m: sum(p.numel() for p in m.parameters())))


class _CheckedWindows(TokenWindows):
    """tokens.py's windows, each checked against the vocabulary: an out-of-range id would
    otherwise fail deep inside the embedding with an index error."""

    def __init__(self, vocab: int, *args: Any) -> None:
        super().__init__(*args)
        self.vocab = vocab

    def __getitem__(self, i: int) -> torch.Tensor:
        window = super().__getitem__(i)
        if int(window.max()) >= self.vocab:
            raise ValueError(f"{self.path}: token id {int(window.max())} in sample {i} is outside the "
                             f"model's vocabulary of {self.vocab}; tokenize with the model's tokenizer")
        return window


def make_dataset(cfg: SimpleNamespace, num_samples: int) -> torch.utils.data.Dataset[torch.Tensor]:
    vocab, seq_len = _load_config(cfg.config).vocab_size, units_per_sample(cfg)
    if not cfg.tokens:
        return Sequences(num_samples, seq_len, vocab)
    if not os.path.isfile(cfg.tokens):
        raise WorkloadError(f"--tokens {cfg.tokens!r}: no such file; make one with "
                            "scripts/make_tokens.py (uint16 token ids, nanoGPT's train.bin format)")
    total = os.path.getsize(cfg.tokens) // 2
    return _CheckedWindows(vocab, cfg.tokens, num_samples, seq_len, 0, total, 0.0, 1_000_003)


def loss_fn(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))

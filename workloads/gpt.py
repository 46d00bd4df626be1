"""A decoder-only transformer with named size presets, from a CPU-sized `tiny` up to 70B shapes.

Two block styles:
- Llama (the default): RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention, no biases,
  separate input embedding and output head. Presets tiny ... xl, llama2-7b/13b/34b/70b,
  llama3-8b/70b.
- MPT (llm-foundry's benchmark configs): LayerNorm, GELU MLP with ffn = 4 x dim, learned absolute
  positions, biases, output head tied to the input embedding, kv_heads == heads. Presets
  mpt-125m, mpt-350m, mpt-760m, mpt-1b, mpt-3b, mpt-7b, mpt-13b, mpt-30b, mpt-70b.

Any preset's shape and style can be changed: `--dim --layers --heads --kv-heads --ffn --vocab
--seq-len` (0 keeps the preset's), `--norm rmsnorm|layernorm`, `--mlp swiglu|gelu`,
`--pos rope|learned` ("" keeps the preset's), `--tie-embeddings`, `--bias`; `--attention eager`
writes attention out (q @ k^T, mask, softmax, @ v, as Hugging Face's "eager" and Megatron-LM's
unfused path run it) instead of PyTorch's scaled_dot_product_attention (`sdpa`, the default).

The large presets are for planning: `dlaunch plan workloads/gpt.py -- --size llama3-70b` builds
them on the meta device only. Data is synthetic but learnable: each sequence follows
x[t+1] = (x[t] + d) mod vocab with x[0] and d in {1, 2, 3} drawn from the sample's own seed.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

# name: (dim, layers, heads, kv_heads, ffn_hidden, vocab, seq_len)
PRESETS = {
    "tiny": (256, 4, 4, 4, 768, 2048, 128),
    "small": (768, 12, 12, 12, 2048, 50304, 1024),  # GPT-2 small scale, ~125M
    "medium": (1024, 24, 16, 16, 2816, 50304, 1024),  # ~350M
    "xl": (2048, 24, 16, 16, 5504, 50304, 2048),  # ~1.3B
    # Llama 2 (Touvron et al. 2023, Table 1; 34B as in Code Llama) and Llama 3 (Meta 2024)
    "llama2-7b": (4096, 32, 32, 32, 11008, 32000, 4096),
    "llama2-13b": (5120, 40, 40, 40, 13824, 32000, 4096),
    "llama2-34b": (8192, 48, 64, 8, 22016, 32000, 4096),
    "llama2-70b": (8192, 80, 64, 8, 28672, 32000, 4096),
    "llama3-8b": (4096, 32, 32, 8, 14336, 128256, 8192),
    "llama3-70b": (8192, 80, 64, 8, 28672, 128256, 8192),
    # llm-foundry scripts/train/yamls/pretrain/mpt-*.yaml (vocab 50368, expansion ratio 4)
    "mpt-125m": (768, 12, 12, 12, 3072, 50368, 2048),
    "mpt-350m": (1024, 24, 16, 16, 4096, 50368, 2048),
    "mpt-760m": (1536, 24, 12, 12, 6144, 50368, 2048),
    "mpt-1b": (2048, 24, 16, 16, 8192, 50368, 2048),
    "mpt-3b": (2560, 32, 20, 20, 10240, 50368, 2048),
    "mpt-7b": (4096, 32, 32, 32, 16384, 50368, 2048),
    "mpt-13b": (5120, 40, 40, 40, 20480, 50368, 2048),
    "mpt-30b": (7168, 48, 56, 56, 28672, 50368, 2048),
    "mpt-70b": (8192, 80, 64, 64, 32768, 50368, 2048),
}
LLAMA_STYLE = {"norm": "rmsnorm", "mlp": "swiglu", "pos": "rope", "tied": False, "bias": False}
MPT_STYLE = {"norm": "layernorm", "mlp": "gelu", "pos": "learned", "tied": True, "bias": True}
CHOICES = {"norm": ("rmsnorm", "layernorm"), "mlp": ("swiglu", "gelu"), "pos": ("rope", "learned")}
ATTENTION = ("sdpa", "eager")

DEFAULTS = {"size": "tiny", "seq_len": 0, "vocab": 0, "dim": 0, "layers": 0, "heads": 0,
            "kv_heads": 0, "ffn": 0, "norm": "", "mlp": "", "pos": "", "tie_embeddings": False,
            "bias": False, "attention": "sdpa"}
SAMPLE_UNITS = "tokens"


def _shape(cfg):
    """The resolved shape and style: preset values, overridden by any option that is set."""
    if cfg.size not in PRESETS:
        raise ValueError(f"unknown --size {cfg.size!r}; choose from {', '.join(PRESETS)}")
    dim, layers, heads, kv, ffn, vocab, seq = PRESETS[cfg.size]
    style = dict(MPT_STYLE if cfg.size.startswith("mpt-") else LLAMA_STYLE)
    for key, choices in CHOICES.items():
        value = getattr(cfg, key, "")
        if value and value not in choices:
            raise ValueError(f"--{key} {value!r}: choose from {', '.join(choices)}")
        style[key] = value or style[key]
    heads = getattr(cfg, "heads", 0) or heads
    # a changed head count without --kv-heads keeps the preset's grouping (MHA stays MHA)
    kv = getattr(cfg, "kv_heads", 0) or (heads if kv == PRESETS[cfg.size][2] else kv)
    shape = SimpleNamespace(
        dim=getattr(cfg, "dim", 0) or dim, layers=getattr(cfg, "layers", 0) or layers,
        heads=heads, kv_heads=kv, ffn=getattr(cfg, "ffn", 0) or ffn, vocab=cfg.vocab or vocab,
        seq_len=cfg.seq_len or seq, tied=style["tied"] or getattr(cfg, "tie_embeddings", False),
        bias=style["bias"] or getattr(cfg, "bias", False),
        norm=style["norm"], mlp=style["mlp"], pos=style["pos"])
    if getattr(cfg, "attention", "sdpa") not in ATTENTION:
        raise ValueError(f"--attention {cfg.attention!r}: choose from {', '.join(ATTENTION)}")
    shape.attention = getattr(cfg, "attention", "sdpa")
    if shape.dim % shape.heads or shape.heads % shape.kv_heads:
        raise ValueError(f"--dim {shape.dim} must split into --heads {shape.heads}, and heads "
                         f"into --kv-heads {shape.kv_heads} groups")
    return shape


def units_per_sample(cfg):
    """Tokens per sequence."""
    return _shape(cfg).seq_len


def _rotary(x, base=10000.0):
    # computed per call (no buffers) so the model builds and runs on the meta device as is
    b, h, t, d = x.shape
    half = d // 2
    freqs = torch.exp(-math.log(base) * torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = torch.arange(t, device=x.device, dtype=torch.float32)[:, None] * freqs[None, :]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def _norm(s):
    return nn.RMSNorm(s.dim) if s.norm == "rmsnorm" else nn.LayerNorm(s.dim, bias=s.bias)


class Attention(nn.Module):
    def __init__(self, s):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = s.heads, s.kv_heads, s.dim // s.heads
        self.rope, self.eager = s.pos == "rope", s.attention == "eager"
        self.wq = nn.Linear(s.dim, s.dim, bias=s.bias)
        self.wk = nn.Linear(s.dim, s.kv_heads * self.head_dim, bias=s.bias)
        self.wv = nn.Linear(s.dim, s.kv_heads * self.head_dim, bias=s.bias)
        self.wo = nn.Linear(s.dim, s.dim, bias=s.bias)

    def forward(self, x):
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism (tp_plan) this rank's projections hold its heads
        # alone (heads / tp of them), over the whole sequence, so rotary positions are global
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        if self.rope:
            q, k = _rotary(q), _rotary(k)
        if self.kv_heads != self.heads:
            rep = self.heads // self.kv_heads  # the same locally: tp divides both head counts
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if self.eager:
            scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            y = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, s):
        super().__init__()
        self.attn_norm, self.ffn_norm = _norm(s), _norm(s)
        self.attn = Attention(s)
        self.swiglu = s.mlp == "swiglu"
        self.w1 = nn.Linear(s.dim, s.ffn, bias=s.bias)
        if self.swiglu:
            self.w3 = nn.Linear(s.dim, s.ffn, bias=s.bias)
        self.w2 = nn.Linear(s.ffn, s.dim, bias=s.bias)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        h = self.ffn_norm(x)
        if self.swiglu:
            return x + self.w2(F.silu(self.w1(h)) * self.w3(h))
        return x + self.w2(F.gelu(self.w1(h)))


class GPT(nn.Module):
    def __init__(self, s):
        super().__init__()
        self.embed = nn.Embedding(s.vocab, s.dim)
        self.pos = nn.Embedding(s.seq_len, s.dim) if s.pos == "learned" else None
        self.layers = nn.ModuleList(Block(s) for _ in range(s.layers))
        self.norm = _norm(s)
        self.head = nn.Linear(s.dim, s.vocab, bias=False)
        if s.tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens):
        x = self.embed(tokens)
        if self.pos is not None:
            # under sequence parallelism both are this rank's slice of the sequence (tp_plan)
            x = x + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def build_model(cfg):
    return GPT(_shape(cfg))


def blocks(model):
    return list(model.layers)


def _gathered_sequence_parallel():
    """SequenceParallel (the norm on this rank's rows of the sequence) whose output is then
    all-gathered once (Replicate) for the MLP's input projections: w1 and w3 would each gather
    it again from Shard(1) otherwise."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import SequenceParallel

    class GatheredSequenceParallel(SequenceParallel):
        def _apply(self, module, device_mesh):
            module = super()._apply(module, device_mesh)
            module.register_forward_hook(lambda _m, _i, out: out.redistribute(placements=[Replicate()]))
            return module

    return GatheredSequenceParallel()


def tp_plan(model, tp):
    """Tensor parallelism of degree `tp` with sequence parallelism (Megatron-style, as torchtitan
    splits Llama): attention heads and MLP hidden units split over the tp ranks, the residual
    stream, norms and embeddings' outputs split along the sequence (dim 1) between blocks.

    Each block all-gathers its input's sequence before attention and before the MLP and
    reduce-scatters their outputs back onto it; the head keeps the logits split over the
    vocabulary, a DTensor (torchtitan's loss parallel: the cross entropy runs on each rank's
    slice inside `loss_parallel()`, which dlaunch's harness enters for tensor-parallel runs, so
    no rank holds the whole logits or their gradient). Learned positions are split like the
    sequence (vocabulary-parallel lookup, reduce-scattered onto the rows). None where `tp` does
    not divide the heads, the kv heads, the MLP's hidden size or the vocabulary.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    attn, block = model.layers[0].attn, model.layers[0]
    sizes = (attn.heads, attn.kv_heads, block.w1.out_features, model.head.out_features)
    if tp < 1 or any(n % tp for n in sizes):
        return None
    plan = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        "layers.*.attn_norm": SequenceParallel(),
        "layers.*.attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "layers.*.attn.wq": ColwiseParallel(),
        "layers.*.attn.wk": ColwiseParallel(),
        "layers.*.attn.wv": ColwiseParallel(),
        "layers.*.attn.wo": RowwiseParallel(output_layouts=Shard(1)),
        # the MLP is no module of its own: its norm hands w1 (and w3) the gathered sequence
        "layers.*.ffn_norm": _gathered_sequence_parallel(),
        "layers.*.w1": ColwiseParallel(),
        "layers.*.w2": RowwiseParallel(output_layouts=Shard(1)),
    }
    if block.swiglu:
        plan["layers.*.w3"] = ColwiseParallel()
    if model.pos is not None:
        # positions 0..t-1 (replicated) -> this rank's rows of the sequence, as `embed` gives
        plan["pos"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0))
    return plan


class Sequences(torch.utils.data.Dataset):
    def __init__(self, num_samples, seq_len, vocab):
        self.n, self.seq_len, self.vocab = num_samples, seq_len, vocab

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(1_000_003 + i)
        x0 = int(torch.randint(0, self.vocab, (1,), generator=g))
        stride = int(torch.randint(1, 4, (1,), generator=g))
        return (x0 + stride * torch.arange(self.seq_len + 1, dtype=torch.int64)) % self.vocab


def make_dataset(cfg, num_samples):
    s = _shape(cfg)
    return Sequences(num_samples, s.seq_len, s.vocab)


def loss_fn(model, batch):
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))

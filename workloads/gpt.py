"""A decoder-only transformer (Llama-style: RMSNorm, rotary positions, SwiGLU, grouped-query
attention) with named size presets, from a CPU-sized `tiny` up to Llama-3 8B / 70B shapes.

The large presets are for planning: `dlaunch plan workloads/gpt.py -- --size llama3-70b` builds
them on the meta device only. Data is synthetic but learnable: each sequence follows
x[t+1] = (x[t] + d) mod vocab with x[0] and d in {1, 2, 3} drawn from the sample's own seed.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

# name: (dim, layers, heads, kv_heads, ffn_hidden, vocab, seq_len)
PRESETS = {
    "tiny": (256, 4, 4, 4, 768, 2048, 128),
    "small": (768, 12, 12, 12, 2048, 50304, 1024),  # GPT-2 small scale, ~125M
    "medium": (1024, 24, 16, 16, 2816, 50304, 1024),  # ~350M
    "xl": (2048, 24, 16, 16, 5504, 50304, 2048),  # ~1.3B
    "llama3-8b": (4096, 32, 32, 8, 14336, 128256, 8192),
    "llama3-70b": (8192, 80, 64, 8, 28672, 128256, 8192),
}

DEFAULTS = {"size": "tiny", "seq_len": 0, "vocab": 0}
SAMPLE_UNITS = "tokens"


def _shape(cfg):
    if cfg.size not in PRESETS:
        raise ValueError(f"unknown --size {cfg.size!r}; choose from {', '.join(PRESETS)}")
    dim, layers, heads, kv, ffn, vocab, seq = PRESETS[cfg.size]
    return dim, layers, heads, kv, ffn, cfg.vocab or vocab, cfg.seq_len or seq


def units_per_sample(cfg):
    """Tokens per sequence."""
    return _shape(cfg)[6]


def _rotary(x, base=10000.0):
    # computed per call (no buffers) so the model builds and runs on the meta device as is
    b, h, t, d = x.shape
    half = d // 2
    freqs = torch.exp(-math.log(base) * torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = torch.arange(t, device=x.device, dtype=torch.float32)[:, None] * freqs[None, :]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rotary(q), _rotary(k)
        if self.kv_heads != self.heads:
            rep = self.heads // self.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, dim, heads, kv_heads, ffn):
        super().__init__()
        self.attn_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attn = Attention(dim, heads, kv_heads)
        self.w1 = nn.Linear(dim, ffn, bias=False)
        self.w3 = nn.Linear(dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class GPT(nn.Module):
    def __init__(self, dim, layers, heads, kv_heads, ffn, vocab):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, kv_heads, ffn) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def build_model(cfg):
    dim, layers, heads, kv, ffn, vocab, _ = _shape(cfg)
    return GPT(dim, layers, heads, kv, ffn, vocab)


def blocks(model):
    return list(model.layers)


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
    _, _, _, _, _, vocab, seq = _shape(cfg)
    return Sequences(num_samples, seq, vocab)


def loss_fn(model, batch):
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))

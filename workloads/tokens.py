"""workloads/gpt.py's model trained on a token file on disk: a flat uint16 array (nanoGPT's
train.bin format), memory-mapped, read one window of seq_len + 1 tokens per sample.

    python scripts/make_tokens.py README.md --repeat 20 -o /tmp/tokens.bin
    dlaunch run workloads/tokens.py --num-workers 2 -- --data /tmp/tokens.bin

The file is `--data`, else $DLAUNCH_TOKENS. The last `--val-share` of it is held out for
`evaluate` (run with --eval-every N); the rest is training data. Sample i starts at an offset
drawn from its own seed, so item i is the same in every rank, worker and attempt. The model is
gpt.py's (imported as a neighbour), vocabulary 256 (byte-level tokens) unless `--vocab` says
otherwise; the optimizer is AdamW with weight decay on the matrices only, after a linear
warm-up then cosine decay to a tenth.

`--read-delay-ms` sleeps in every read, a stand-in for slow storage: without DataLoader workers
the loop waits for it, with `--num-workers` it is hidden behind the compute.
"""

import math
import os
import time

import gpt
import numpy as np
import torch
from gpt import blocks, build_model, loss_fn, units_per_sample  # noqa: F401 - the contract

DEFAULTS = {**gpt.DEFAULTS, "vocab": 256, "data": "", "val_share": 0.1, "read_delay_ms": 0.0,
            "lr": 3e-3, "weight_decay": 0.1, "warmup": 10, "decay_steps": 1000, "eval_batches": 2}
SAMPLE_UNITS = gpt.SAMPLE_UNITS


def _path(cfg):
    path = cfg.data or os.environ.get("DLAUNCH_TOKENS", "")
    if not path:
        raise ValueError("no token file: give `-- --data FILE` or set DLAUNCH_TOKENS "
                         "(make one with scripts/make_tokens.py)")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"token file {path!r} not found; make one with "
                                "scripts/make_tokens.py")
    return path


class TokenWindows(torch.utils.data.Dataset):
    """`num_samples` windows of seq_len + 1 tokens from tokens [start, stop) of the file."""

    def __init__(self, path, num_samples, seq_len, start, stop, read_delay_s, seed):
        if stop - start <= seq_len + 1:
            raise ValueError(f"{path}: {stop - start} tokens, fewer than one sample of "
                             f"{seq_len + 1}; make a larger file (scripts/make_tokens.py --repeat)")
        self.path, self.n, self.seq_len = path, num_samples, seq_len
        self.start, self.stop, self.read_delay_s, self.seed = start, stop, read_delay_s, seed
        self._tokens = None  # opened in the process that reads (each DataLoader worker its own)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=np.uint16, mode="r")
        if self.read_delay_s:
            time.sleep(self.read_delay_s)
        g = torch.Generator().manual_seed(self.seed + i)
        at = self.start + int(torch.randint(0, self.stop - self.start - self.seq_len - 1, (1,), generator=g))
        return torch.from_numpy(self._tokens[at:at + self.seq_len + 1].astype(np.int64))


def _split(cfg):
    path = _path(cfg)
    total = os.path.getsize(path) // 2
    return path, total, int(total * (1 - cfg.val_share))


def make_dataset(cfg, num_samples):
    path, _, val_start = _split(cfg)
    return TokenWindows(path, num_samples, units_per_sample(cfg), 0, val_start,
                        cfg.read_delay_ms / 1000.0, seed=1_000_003)


def make_optimizer(cfg, model):
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))


def make_scheduler(cfg, optimizer):
    def factor(step):
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        progress = min(1.0, (step - cfg.warmup) / max(1, cfg.decay_steps - cfg.warmup))
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def evaluate(model, cfg):
    path, total, val_start = _split(cfg)
    data = TokenWindows(path, 4 * cfg.eval_batches, units_per_sample(cfg), val_start, total, 0.0,
                        seed=7)
    device = next(model.parameters()).device
    losses = [loss_fn(model, torch.stack([data[j] for j in range(b, b + 4)]).to(device)).item()
              for b in range(0, len(data), 4)]
    return {"val_loss": sum(losses) / len(losses)}

"""What CPU offload's host side costs on this machine: the numbers `launcher/plan/offload.py` prices.

    PYTHONPATH=. python benchmarks/host_offload.py [--blocks 8] [--hidden 4096] [--ffn 11008] [--repeats 3]

- the host's streaming bandwidth with every thread torch uses (an out-of-place add over 512 MiB,
  read + write counted), the figure `Host.mem_bw_gb_s` stands for;
- torch's AdamW step on the CPU (the workload's default: the per-tensor loop) and with fused=True,
  over `--blocks` Llama-style blocks of fp32 parameters (four hidden x hidden, three hidden x ffn
  matrices each: 202M parameters a block at 4096/11008), as seconds per step and as bytes per
  parameter at the measured bandwidth (`HOST_ADAMW_BYTES_PER_PARAM`);
- on a CUDA host, pinned copies of 1 GiB to the GPU and back (`Host.link_gb_s`);
- with --fsdp, one rank's FSDP2 step under `CPUOffloadPolicy` over the same blocks (bf16 compute,
  one micro-batch of --tokens): forward + backward (the link's copies with the blocks' compute)
  and the optimizer step (dlaunch's default AdamW: fused on CUDA ranks), each timed alone.

Each figure is the best of --repeats after one warm-up. Needs ~16 B x the parameters of host memory
(8 blocks: 26 GB). Prints the CPU, the threads and the load beside the numbers.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
from cli_start import cpu_model

from launcher.plan.cpu_probe import host_stream


def best_s(fn: Callable[[], object], repeats: int, sync: Callable[[], None] = lambda: None) -> float:
    """The fastest of `repeats` timed calls of `fn`, after one untimed call."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times)


def adamw_s(blocks: int, hidden: int, ffn: int, repeats: int, fused: bool) -> tuple[float, int]:
    """(seconds of one AdamW step, parameters) over `blocks` blocks of fp32 CPU parameters with gradients."""
    shapes = [(hidden, hidden)] * 4 + [(hidden, ffn), (ffn, hidden), (hidden, ffn)]
    params = []
    for _ in range(blocks):
        for shape in shapes:
            p = torch.nn.Parameter(torch.zeros(shape))
            p.grad = torch.full(shape, 1e-3)
            params.append(p)
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)
    numel = sum(p.numel() for p in params)
    return best_s(opt.step, repeats), numel


def link_gb_s(repeats: int) -> tuple[float, float]:
    """(host to device, device to host) GB/s of 1 GiB pinned copies."""
    host = torch.empty(1 << 28).pin_memory()
    dev = torch.empty(1 << 28, device="cuda")
    sync = torch.cuda.synchronize
    h2d = best_s(lambda: dev.copy_(host, non_blocking=True), repeats, sync)
    d2h = best_s(lambda: host.copy_(dev, non_blocking=True), repeats, sync)
    return 4 * host.numel() / h2d / 1e9, 4 * host.numel() / d2h / 1e9


def fsdp_split(blocks: int, hidden: int, ffn: int, tokens: int, repeats: int) -> tuple[float, float, float, int]:
    """(forward s, backward s, optimizer step s, parameters) of one rank's FSDP2 step with CPU offload."""
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)

    def block() -> torch.nn.Module:
        return torch.nn.Sequential(*(torch.nn.Linear(hidden, hidden, bias=False) for _ in range(4)),
                                   torch.nn.Linear(hidden, ffn, bias=False), torch.nn.SiLU(),
                                   torch.nn.Linear(ffn, hidden, bias=False), torch.nn.Linear(hidden, ffn, bias=False),
                                   torch.nn.SiLU(), torch.nn.Linear(ffn, hidden, bias=False))

    model = torch.nn.Sequential(*(block() for _ in range(blocks)))
    policy = dict(offload_policy=CPUOffloadPolicy(pin_memory=cuda),
                  mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    for b in model:
        fully_shard(b, **policy)
    fully_shard(model, **policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    x = torch.randn(tokens, hidden, device=device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        marks = [time.perf_counter()]
        loss = model(x).float().square().mean()
        sync()
        marks.append(time.perf_counter())
        loss.backward()
        sync()
        marks.append(time.perf_counter())
        opt.step()
        opt.zero_grad()
        sync()
        marks.append(time.perf_counter())
        times.append([b - a for a, b in zip(marks, marks[1:])])
    fwd, bwd, step = (min(t[i] for t in times[1:]) for i in range(3))
    dist.destroy_process_group()
    return fwd, bwd, step, sum(p.numel() for p in model.parameters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=11008)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fsdp", action="store_true", help="also time an FSDP2 step with CPU offload")
    ap.add_argument("--tokens", type=int, default=2048)
    args = ap.parse_args()
    print(f"CPU {cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"load {os.getloadavg()[0]:.2f}")
    bw = host_stream().gb_s  # the plan's own probe
    print(f"host stream (512 MiB add, all threads): {bw:.1f} GB/s")
    for fused in (False, True):
        s, n = adamw_s(args.blocks, args.hidden, args.ffn, args.repeats, fused)
        print(f"AdamW fused={fused}: {s:.3f} s for {n / 1e6:.0f}M params = {n / s / 1e6:.0f}M params/s "
              f"= {bw * 1e9 * s / n:.1f} B/param at the stream bandwidth")
    if torch.cuda.is_available():
        h2d, d2h = link_gb_s(args.repeats)
        print(f"pinned copies, 1 GiB: host to device {h2d:.1f} GB/s, device to host {d2h:.1f} GB/s")
    if args.fsdp:
        fwd, bwd, step, n = fsdp_split(args.blocks, args.hidden, args.ffn, args.tokens, args.repeats)
        print(f"FSDP2 + CPU offload, {n / 1e6:.0f}M params, {args.tokens} tokens: forward {fwd:.3f} s "
              f"({4 * n / fwd / 1e9:.1f} GB/s of fp32 shards in), backward {bwd:.3f} s ({8 * n / bwd / 1e9:.1f} GB/s "
              f"of shards in and grads out), optimizer step + zero_grad {step:.3f} s ({n / step / 1e6:.0f}M params/s)")


if __name__ == "__main__":
    main()

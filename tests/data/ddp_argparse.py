"""A torchrun DDP script as people write them: its own argparse, its own DataLoader with a
DistributedSampler, gradient accumulation, no dlaunch import. It prints its own count of
optimizer steps and samples, which dlaunch's measurement is checked against."""

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--accum", type=int, default=2)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(4096, 32), torch.randn(4096, 1))
    loader = DataLoader(data, batch_size=args.batch_size, sampler=DistributedSampler(data), drop_last=True)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = samples = 0
    batches = iter(loader)
    while steps < args.steps:
        for _ in range(args.accum):
            x, y = next(batches)
            loss = nn.functional.mse_loss(model(x), y) / args.accum
            loss.backward()
            samples += len(x)
        opt.step()
        opt.zero_grad()
        steps += 1
    print(f"script counted rank {rank}/{world}: {steps} steps, {samples} samples")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

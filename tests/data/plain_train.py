"""An ordinary torchrun training script: its own process group, its own loop.

dlaunch launches it unchanged; the optional StepMeter makes its throughput show up.
"""

import atexit
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from launcher.runtime.meter import StepMeter


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 1 and (code := int(os.environ.get("PLAIN_RANK1_EXIT_CODE_AT_EXIT", "0"))):
        # registered before the StepMeter's summary writer: runs after it (atexit is last in, first out)
        atexit.register(os._exit, code)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = int(os.environ.get("PLAIN_STEPS", "8"))
    meter = StepMeter(samples_per_step=16)
    for step in range(steps):
        x = torch.randn(16, 32)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        meter.step(loss=loss.detach())
        if rank == 1 and step + 1 == int(os.environ.get("PLAIN_RANK1_EXITS_AFTER", "0")):
            sys.exit(0)  # leaves while rank 0 goes on into the next step's all-reduce
    print(f"plain script rank {rank}/{world} done")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A plain torchrun script with a StepMeter whose rank 0 hangs after a few fast steps.

  METER_HANG_STEP   the step after which rank 0 sleeps for an hour (default 5)
"""

import os
import time

import torch
import torch.distributed as dist
from torch import nn

from launcher.runtime.meter import StepMeter


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hang = int(os.environ.get("METER_HANG_STEP", "5"))
    meter = StepMeter(samples_per_step=4)
    for step in range(1, 1000):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        meter.step(loss=loss.detach())
        if step == hang and rank == 0:
            time.sleep(3600)


if __name__ == "__main__":
    main()

"""A GPU tutorial script, unchanged but for the backend: DDP with device_ids on a CPU model."""

import os

import torch.distributed as dist
from torch import nn

if __name__ == "__main__":
    dist.init_process_group("gloo")
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 4), device_ids=[int(os.environ["LOCAL_RANK"])])
    print("never reached: device_ids needs a GPU model")
    dist.destroy_process_group()

"""A GPU tutorial script, unchanged: it pins each rank to a CUDA device, on a host without one."""

import os

import torch
import torch.distributed as dist

if __name__ == "__main__":
    dist.init_process_group("gloo")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    print("never reached without a GPU")
    dist.destroy_process_group()

"""A GPU tutorial script, unchanged: it asks for NCCL, which a CPU-only host does not have."""

import torch.distributed as dist

if __name__ == "__main__":
    dist.init_process_group("nccl")
    print("never reached on CPU")
    dist.destroy_process_group()

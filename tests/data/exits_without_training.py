"""pytorch/examples' DDP example on a host without GPUs: it checks, prints and exits 0."""

import torch

if __name__ == "__main__":
    if torch.cuda.device_count() < 2:
        print("Unable to locate sufficient 2 gpus to run this example. Exiting.")
    else:
        print("would train here")

"""A plain Hugging Face Accelerate training script (no dlaunch import), as users write them:
`Accelerator()`, `prepare`, `accelerator.backward`. Each process prints who it is and which
processes its group holds (an all-gather of the process indices), then trains a few steps with
gradients averaged over the group."""

import torch
from accelerate import Accelerator
from torch import nn


def main() -> None:
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    group = accelerator.gather(torch.tensor([accelerator.process_index])).tolist()
    print(f"accelerate: process {accelerator.process_index} of {accelerator.num_processes}, "
          f"group {sorted(group)}, device {accelerator.device.type}", flush=True)
    g = torch.Generator().manual_seed(accelerator.process_index)
    for _ in range(5):
        x = torch.randn(4, 8, generator=g)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        accelerator.backward(loss)
        optimizer.step()
    # the same weights on every process: the gradients were averaged over one group
    weights = accelerator.gather(accelerator.unwrap_model(model).weight.detach().reshape(1, -1))
    print(f"accelerate: process {accelerator.process_index} weights equal across the group: "
          f"{bool(torch.allclose(weights, weights[0].expand_as(weights)))}", flush=True)


if __name__ == "__main__":
    main()

"""A Lightning script as people write them (`Trainer(strategy="ddp")`, a LightningModule,
gradient accumulation, no dlaunch import). It prints Lightning's own count of optimizer steps
and the samples they took, which dlaunch's measurement is checked against."""

import argparse

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

BATCH, ACCUM = 8, 2


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))

    def training_step(self, batch, index):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=12)
    args = parser.parse_args()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(4096, 32), torch.randn(4096, 1))
    # devices=2 on CPU: Lightning reads torchrun's environment and joins its ranks
    trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_steps=args.max_steps,
                        accumulate_grad_batches=ACCUM, enable_progress_bar=False, logger=False,
                        enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(Model(), DataLoader(data, batch_size=BATCH))
    steps = trainer.global_step
    print(f"lightning counted rank {trainer.global_rank}: {steps} steps, {steps * BATCH * ACCUM} samples")


if __name__ == "__main__":
    main()

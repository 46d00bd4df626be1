"""The baseline of benchmarks/overhead.py: a minimal hand-written torchrun DDP loop.

Same model (workloads/gpt.py tiny), same data, sampler, optimizer and steps as `dlaunch run`;
it writes the end time of each step to $RAW_OUT/rank-<r>.json.
"""

import importlib.util
import json
import os
import sys
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    steps, micro_batch = int(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = importlib.util.spec_from_file_location("gpt", REPO / "workloads" / "gpt.py")
    gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpt)
    cfg = types.SimpleNamespace(**gpt.DEFAULTS)
    torch.manual_seed(0)
    model = DDP(gpt.build_model(cfg), gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ds = gpt.make_dataset(cfg, steps * micro_batch * world)
    loader = DataLoader(ds, batch_size=micro_batch, drop_last=True,
                        sampler=DistributedSampler(ds, world, rank, shuffle=True, seed=0, drop_last=True))
    ends, times = [], []
    for batch in loader:
        t = time.perf_counter()
        loss = gpt.loss_fn(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
        ends.append(time.time())
    out = Path(os.environ["RAW_OUT"]) / f"rank-{rank}.json"
    out.write_text(json.dumps({"end_times": ends, "step_times": times, "micro_batch": micro_batch}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

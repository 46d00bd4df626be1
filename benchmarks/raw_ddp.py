"""The baseline of benchmarks/overhead.py: a minimal hand-written torchrun DDP loop.

    torchrun --nproc-per-node 2 benchmarks/raw_ddp.py WORKLOAD STEPS MICRO_BATCH [PRECISION]

Same model (workloads/<WORKLOAD>.py at its defaults), data, sampler, optimizer and steps as
`dlaunch run`; PRECISION is fp32 (default) or bf16 (autocast around the loss, as anyone would
write it). It writes each step's end time and duration to $RAW_OUT/raw-rank<r>.json. With
RAW_PROFILE=DIR it also writes a torch.profiler trace of steps 5-7 (after 3 warm-up steps and
one profiler warm-up step, dlaunch's `--profile` schedule) to DIR/raw-trace-rank<r>.json.
"""

import contextlib
import importlib.util
import json
import os
import sys
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist
import torch.profiler as tp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    name, steps, micro_batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    precision = sys.argv[4] if len(sys.argv) > 4 else "fp32"
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = importlib.util.spec_from_file_location(name, REPO / "workloads" / f"{name}.py")
    workload = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(workload)
    cfg = types.SimpleNamespace(**workload.DEFAULTS)
    torch.manual_seed(0)
    model = DDP(workload.build_model(cfg), gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ds = workload.make_dataset(cfg, steps * micro_batch * world)
    loader = DataLoader(ds, batch_size=micro_batch, drop_last=True,
                        sampler=DistributedSampler(ds, world, rank, shuffle=True, seed=0, drop_last=True))
    profile_dir = os.environ.get("RAW_PROFILE")
    prof = (tp.profile(activities=[tp.ProfilerActivity.CPU],
                       schedule=tp.schedule(wait=3, warmup=1, active=3, repeat=1),
                       on_trace_ready=lambda p: p.export_chrome_trace(
                           str(Path(profile_dir) / f"raw-trace-rank{rank}.json")))
            if profile_dir else contextlib.nullcontext())
    ends, times = [], []
    with prof:
        for batch in loader:
            t = time.perf_counter()
            if precision == "bf16":
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = workload.loss_fn(model, batch)
            else:
                loss = workload.loss_fn(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t)
            ends.append(time.time())
            if profile_dir:
                prof.step()
    out = Path(os.environ["RAW_OUT"]) / f"raw-rank{rank}.json"
    out.write_text(json.dumps({"end_times": ends, "step_times": times, "micro_batch": micro_batch}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""The memory model against real training steps: measured peak vs the plan's
params + grads + optimizer + activations, for every shipped workload at two micro-batch sizes.

    .venv/bin/python benchmarks/memory_truth.py [--device cpu|cuda] [--precision fp32 bf16]

One process, no wrapper (DDP on one rank adds nothing: its buckets are the gradients), AdamW
(fused on CUDA, foreach on CPU, as the runtime picks), two optimizer steps so the second starts
with optimizer state. The peak is `torch.cuda.max_memory_allocated` on CUDA and the peak of live
tensor storages (`launcher.runtime.live_bytes`) on CPU, which has no allocator statistics.
`tests/unit/test_memory_truth.py` runs the CPU half with a 10% bar.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CASES = [("gpt.py", 2), ("gpt.py", 8), ("mlp.py", 64), ("mlp.py", 512), ("resnet.py", 4), ("resnet.py", 16)]


def measured_peak(workload: Any, micro_batch: int, *, device: str = "cpu", precision: str = "fp32") -> int:
    """Peak bytes of two real training steps of `workload` at `micro_batch` on `device`."""
    import torch

    from launcher.runtime.live_bytes import LiveBytes

    torch.manual_seed(0)
    model = workload.build_model().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=device == "cuda")
    data = workload.make_dataset(2 * micro_batch)
    batches = [torch.utils.data.default_collate([data[i] for i in range(k * micro_batch, (k + 1) * micro_batch)])
               for k in range(2)]
    batches = [torch.utils._pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, b)
               for b in batches]
    autocast = (torch.autocast(device, dtype=torch.bfloat16) if precision == "bf16"
                else contextlib.nullcontext())
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        tracker: Any = contextlib.nullcontext()
    else:
        tracker = LiveBytes()
        tracker.add_existing(model.parameters())
    with tracker:
        for batch in batches:
            with autocast:
                loss = workload.loss_fn(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    if device == "cuda":
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated())
    return tracker.peak


def predicted(profile: Any, micro_batch: int, *, device: str, precision: str) -> float:
    """The tensor bytes the plan predicts for one rank of DDP (on CUDA the cuBLAS workspaces
    too, which the caching allocator holds; not the context or the allocator's slack)."""
    from launcher.plan.memory import estimate_memory
    from launcher.results.prediction import plan_tensor_bytes
    from launcher.specs import Strategy

    est = estimate_memory(profile, Strategy(kind="ddp", precision=precision), micro_batch=micro_batch,
                          world_size=1, shard_group_size=1, device=device)
    return plan_tensor_bytes(est, device=device, world_size=1)


def main() -> int:
    """Print predicted vs measured for every case; exit 1 when one is off by 10% or more."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--precision", nargs="+", choices=("fp32", "bf16"), default=["fp32"])
    args = parser.parse_args()
    import torch

    from launcher.plan.profile import profile_workload
    from launcher.workload import load_workload

    if args.device == "cuda" and not torch.cuda.is_available():
        print("memory_truth: --device cuda needs a CUDA GPU; none is visible here", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    worst = 0.0
    print(f"{'workload':10s} {'mb':>4s} {'prec':5s} {'predicted MB':>13s} {'measured MB':>12s} {'error':>7s}")
    for name, micro_batch in CASES:
        workload = load_workload(REPO / "workloads" / name)
        profile = profile_workload(workload)
        for precision in args.precision:
            want = predicted(profile, micro_batch, device=args.device, precision=precision)
            got = measured_peak(workload, micro_batch, device=args.device, precision=precision)
            error = (want - got) / got
            worst = max(worst, abs(error))
            print(f"{name:10s} {micro_batch:4d} {precision:5s} {want / 1e6:13.1f} {got / 1e6:12.1f} {error:+7.1%}")
    if args.device == "cuda":
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"worst |error| {worst:.1%} (bar: 10%)")
    return 0 if worst < 0.10 else 1


if __name__ == "__main__":
    sys.exit(main())

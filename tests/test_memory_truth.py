"""The memory model against measurement: peak live tensor bytes of real CPU training steps
(tracked by launcher.runtime.live_bytes) within 10% of the plan's params + grads + optimizer +
activations, for every shipped workload at two micro-batch sizes."""

import pytest
import torch

from launcher.memory import estimate_memory
from launcher.profile import profile_workload
from launcher.runtime.live_bytes import LiveBytes
from launcher.specs import Strategy
from launcher.workload import load_workload
from tests.helpers import WORKLOADS

CASES = [("gpt.py", 2), ("gpt.py", 8), ("mlp.py", 64), ("mlp.py", 512), ("resnet.py", 4), ("resnet.py", 16)]


def measured_peak(workload, micro_batch: int) -> int:
    torch.manual_seed(0)
    model = workload.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = workload.make_dataset(2 * micro_batch)
    batches = [torch.utils.data.default_collate([data[i] for i in range(k * micro_batch, (k + 1) * micro_batch)])
               for k in range(2)]
    tracker = LiveBytes()
    tracker.add_existing(model.parameters())
    with tracker:
        for batch in batches:  # two steps: the second has optimizer state from the start
            workload.loss_fn(model, batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return tracker.peak


@pytest.mark.parametrize("name, micro_batch", CASES)
def test_memory_estimate_within_10_percent(name, micro_batch):
    torch.set_num_threads(1)
    workload = load_workload(WORKLOADS / name)
    profile = profile_workload(workload)
    est = estimate_memory(profile, Strategy(kind="ddp", precision="fp32"), micro_batch=micro_batch,
                          world_size=1, shard_group_size=1, device="cpu")
    predicted = est.params_bytes + est.grads_bytes + est.optimizer_bytes + est.activations_bytes
    peak = measured_peak(workload, micro_batch)
    assert abs(peak - predicted) / peak < 0.10, (peak / 1e6, predicted / 1e6, est)

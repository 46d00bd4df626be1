"""The memory model against measurement: peak live tensor bytes of real CPU training steps
(tracked by launcher.runtime.live_bytes) within 10% of the plan's params + grads + optimizer +
activations, for every shipped workload at two micro-batch sizes. The measurement lives in
benchmarks/memory_truth.py, which also runs it on CUDA against torch.cuda.max_memory_allocated."""

import pytest
import torch

from launcher.plan.profile import profile_workload
from launcher.workload import load_workload

from benchmarks.memory_truth import CASES, measured_peak, predicted
from tests.helpers import WORKLOADS


@pytest.mark.parametrize("name, micro_batch", CASES)
def test_memory_estimate_within_10_percent(name, micro_batch):
    torch.set_num_threads(1)
    workload = load_workload(WORKLOADS / name)
    want = predicted(profile_workload(workload), micro_batch, device="cpu", precision="fp32")
    peak = measured_peak(workload, micro_batch)
    assert abs(peak - want) / peak < 0.10, (peak / 1e6, want / 1e6)

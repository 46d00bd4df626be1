"""What keeps a cold `dlaunch plan` short without changing its profile: an extrapolated profile
runs backward only through its deepest truncation (the only transient it keeps), and its
transients still equal those of profiling every block."""

import pytest

import launcher.plan.profile_passes as passes_module
from launcher.plan.profile import profile_workload
from launcher.plan.profile_passes import TRANSIENT_BATCHES
from launcher.workload import load_workload

from tests.helpers import WORKLOADS


@pytest.fixture
def backward_calls(monkeypatch):
    """How many blocks the model had each time backward's transient was measured."""
    calls: list[int] = []
    real = passes_module._backward_transient

    def counting(loss, params, tracker):
        calls.append(len(params))
        return real(loss, params, tracker)

    monkeypatch.setattr(passes_module, "_backward_transient", counting)
    return calls


def test_extrapolated_profile_runs_backward_only_at_three_blocks(backward_calls):
    workload = load_workload(WORKLOADS / "gpt.py", ["--size", "small"])
    fast = profile_workload(workload)
    # one backward per transient batch, all on the 3-block model (the same parameter count):
    # the 1- and 2-block truncations' transients were measured and thrown away before
    assert len(backward_calls) == len(TRANSIENT_BATCHES)
    assert len(set(backward_calls)) == 1
    backward_calls.clear()
    full = profile_workload(workload, extrapolate=False)
    assert len(backward_calls) == len(TRANSIENT_BATCHES)
    assert fast.backward_transient_bytes_per_sample == full.backward_transient_bytes_per_sample > 0
    assert fast == full

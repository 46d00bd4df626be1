"""`--profile` on CUDA, on CPU: device time is the kernels' time, counted once (issue 21, 2).

A CUDA profiler table lists every kernel twice: as a device row of its own and inside the self
device time of the CPU op that launched it; a `record_function` range (the optimizer's, FSDP's,
ProfilerStep#N) is a device row too, flagged as a user annotation. The tables here are built the
way torch's profiler builds them (kernels appended to the CPU op that launched them, device rows
on a stream's thread), or as plain rows with the fields `key_averages()` has.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from launcher.results.aggregate import aggregate
from launcher.rundir import RunPaths
from launcher.runtime import profiling

from tests.synthetic import write_run

STEPS = 3  # recorded steps
STEP_US = 10_000  # each 10 ms
KERNEL_US = 4000 + 1000 + 200  # per step: gemm, add, fused AdamW


def kineto_like_table() -> Any:
    """`key_averages()` of three 10 ms steps whose kernels run 5.2 ms of each: torch's own
    FunctionEvents, related as `_parse_kineto_results` relates them."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import EventList, FunctionEvent

    ids = iter(range(1, 1000))

    def cpu(name: str, start: int, end: int, kernels: tuple[tuple[str, int], ...] = (),
            annotation: bool = False) -> Any:
        e = FunctionEvent(id=next(ids), name=name, thread=1, start_us=start, end_us=end,
                          use_device="cuda", is_user_annotation=annotation, stack=[],
                          input_shapes=[])
        for kernel, us in kernels:
            e.append_kernel(kernel, 0, us)
        return e

    def dev(name: str, start: int, end: int, annotation: bool = False) -> Any:
        return FunctionEvent(id=next(ids), name=name, thread=7, start_us=start, end_us=end,
                             use_device="cuda", device_type=DeviceType.CUDA,
                             is_user_annotation=annotation, stack=[], input_shapes=[])

    events = []
    for k in range(STEPS):
        t = k * STEP_US
        events += [cpu(f"ProfilerStep#{k + 5}", t, t + STEP_US, annotation=True),
                   cpu("aten::linear", t + 100, t + 600),
                   cpu("aten::mm", t + 200, t + 500, kernels=(("sm90_gemm", 4000),)),
                   cpu("aten::add_", t + 700, t + 800, kernels=(("elementwise_kernel", 1000),)),
                   cpu("Optimizer.step#AdamW.step", t + 900, t + 1500, annotation=True),
                   cpu("aten::_fused_adamw_", t + 1000, t + 1400,
                       kernels=(("fused_adamw_kernel", 200),)),
                   dev("sm90_gemm", t + 300, t + 4300),
                   dev("elementwise_kernel", t + 4400, t + 5400),
                   dev("fused_adamw_kernel", t + 5500, t + 5700),
                   dev("Optimizer.step#AdamW.step", t + 5500, t + 5700, annotation=True),
                   dev(f"ProfilerStep#{k + 5}", t + 300, t + 5700, annotation=True)]
    table = EventList(events, use_device="cuda")
    table._build_tree()  # cpu_children: an op's self device time leaves its children's out
    return table.key_averages()


@dataclass
class Row:
    """One row of `prof.key_averages()`, the fields dlaunch reads."""

    key: str
    count: int
    self_cpu_time_total: float
    self_device_time_total: float
    device: str = "CPU"
    is_user_annotation: bool = False
    is_legacy: bool = False

    @property
    def device_type(self) -> Any:
        from torch.autograd import DeviceType

        return getattr(DeviceType, self.device)


def plain_table() -> list[Row]:
    """Kernel rows, their CPU ops, annotations on both sides, the runtime's launch calls."""
    return [
        Row("ProfilerStep#5", 1, 8800, 0, is_user_annotation=True),
        Row("ProfilerStep#5", 1, 0, 5400, device="CUDA", is_user_annotation=True),
        Row("aten::mm", 3, 900, 12000),
        Row("aten::add_", 3, 300, 3000),
        Row("aten::_fused_adamw_", 3, 1200, 600),
        Row("cudaLaunchKernel", 9, 450, 0),
        Row("FSDP::post_backward_reduce", 3, 700, 0, is_user_annotation=True),
        Row("FSDP::post_backward_reduce", 3, 0, 9000, device="CUDA", is_user_annotation=True),
        Row("sm90_xmma_gemm_bf16bf16_bf16f32", 3, 0, 12000, device="CUDA"),
        Row("vectorized_elementwise_kernel", 3, 0, 3000, device="CUDA"),
        Row("multi_tensor_apply_kernel", 3, 0, 600, device="CUDA"),
    ]


class FakeProf:
    """What `on_trace_ready` gets, holding a made table."""

    def __init__(self, averages: Any) -> None:
        self.averages = averages

    def export_chrome_trace(self, path: str) -> None:
        Path(path).write_text("{}")

    def key_averages(self) -> Any:
        return self.averages


def cuda_profile_record(averages: Any, run_dir: Path) -> dict[str, Any]:
    """The `profile` record StepProfiler writes on CUDA when its window closes on `averages`."""
    prof = profiling.StepProfiler(run_dir=run_dir, rank=0, warmup_steps=1, steps=6, cuda=True)
    prof._ready(FakeProf(averages))  # the schedule's on_trace_ready callback
    return prof.close()


def torch_table_total_us(averages: Any) -> float:
    """"Self CUDA time total" from torch's own printed table."""
    found = re.search(r"Self CUDA time total: ([\d.]+)(ms|us|s)\b", averages.table())
    assert found, averages.table()
    return float(found[1]) * {"us": 1, "ms": 1e3, "s": 1e6}[found[2]]


def test_device_time_is_the_kernels_once_as_torchs_table_sums_it(tmp_path):
    averages = kineto_like_table()
    record = cuda_profile_record(averages, tmp_path)
    assert torch_table_total_us(averages) == pytest.approx(STEPS * KERNEL_US)
    # not 31.8 ms: the ops' self device time (their kernels again) and the optimizer's range
    assert record["device_time_s"] == pytest.approx(STEPS * KERNEL_US / 1e6)
    assert profiling.device_time_us(plain_table()) == pytest.approx(15600)


def test_top_ops_on_cuda_are_ops_ranked_by_their_kernels_with_shares_of_the_device_time(tmp_path):
    for ops in (cuda_profile_record(kineto_like_table(), tmp_path)["top_ops"],
                profiling.top_ops(plain_table(), cuda=True, steps=STEPS)):
        # kernel rows and annotation ranges are no ops: listed, each kernel would count twice
        assert [op["name"] for op in ops] == ["aten::mm", "aten::add_", "aten::_fused_adamw_"]
        assert [op["share"] for op in ops] == pytest.approx([12 / 15.6, 3 / 15.6, 0.6 / 15.6])
        assert [op["per_step_ms"] for op in ops] == pytest.approx([4.0, 1.0, 0.2])
        assert [op["calls_per_step"] for op in ops] == [1.0, 1.0, 1.0]


def test_profile_summary_gives_cuda_device_time_and_cpu_none():
    on_cuda = profiling.profile_summary(plain_table(), cuda=True, steps=STEPS)
    assert on_cuda["device_time_s"] == pytest.approx(0.0156)
    on_cpu = profiling.profile_summary(plain_table(), cuda=False, steps=STEPS)
    assert "device_time_s" not in on_cpu
    # on CPU the ranking is self CPU time, as before; the schedule's markers stay out
    assert on_cpu["top_ops"][0]["name"] == "aten::_fused_adamw_"
    assert all(not op["name"].startswith("ProfilerStep") for op in on_cpu["top_ops"])


def test_the_launch_bound_verdict_fires_on_a_gpu_busy_half_the_step(tmp_path):
    """5.2 ms of kernels in 10 ms steps: the GPU is busy 52% (< 70%), with no batch wait and one
    rank: launch bound. Counting each kernel twice read 100% and called it compute bound."""
    record = cuda_profile_record(kineto_like_table(), tmp_path)
    run_dir = write_run(tmp_path / "run", world_size=1, steps=10, warmup=2, step_s=STEP_US / 1e6,
                        result=None)
    path = RunPaths(root=run_dir).records(0)
    lines = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec["kind"] == "step" and rec["step"] in record["profiled_steps"]:
            rec["profiled"] = True
        if rec["kind"] == "end":
            lines.append(json.dumps(record))
        lines.append(json.dumps(rec))
    path.write_text("\n".join(lines) + "\n")
    result = aggregate(run_dir, exit_code=0)
    assert result.ranks[0].device_busy_share == pytest.approx(KERNEL_US / STEP_US)
    assert result.verdict is not None
    assert result.verdict["name"] == "launch bound", result.verdict
    assert result.verdict["shares"]["device_busy"] == pytest.approx(0.52)


def test_a_launch_stall_marker_is_no_op_but_its_kernels_count():
    # the first H100 acceptance run listed "Command Buffer Full" as the top op of a compiled step
    table = plain_table() + [Row("Command Buffer Full", 30, 0, 2000)]
    ops = profiling.top_ops(table, cuda=True, steps=STEPS)
    assert "Command Buffer Full" not in [op["name"] for op in ops]
    assert ops[0]["name"] == "aten::mm"

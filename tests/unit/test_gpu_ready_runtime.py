"""The CUDA path's measurements, right by construction and checked on CPU (issue 21): the
calibration's all-reduce sized by this rank's shard and never failing the run (runtime.calibrate),
data wait that a busy device hid (runtime.window), peak memory reset after warm-up and compared
tensors with tensors (runtime.window, results.prediction), and the memory snapshot with Python
stacks and a heartbeat while it is written (runtime.profiling, runtime.recorder).

The CUDA-only calls are replaced by fakes: the decisions around them are what is tested."""

from __future__ import annotations

import json
import multiprocessing
import time
import traceback
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from launcher.plan.memory import CUBLAS_WORKSPACE_BYTES, estimate_memory
from launcher.results.aggregate import aggregate
from launcher.results.prediction import compare, plan_tensor_bytes, prediction_line
from launcher.rundir import RunPaths
from launcher.runspec import LaunchSpec
from launcher.runtime import calibrate, loader, profiling
from launcher.runtime.context import RankContext
from launcher.runtime.recorder import RankRecorder
from launcher.runtime.window import Clock, Window, exposed_wait, peak_reset_step
from launcher.specs import GIB, ModelProfile, Strategy

from tests.synthetic import write_run


def _ctx(world_size: int = 4, rank: int = 1, device_type: str = "cpu") -> RankContext:
    return RankContext(rank=rank, local_rank=0, world_size=world_size, local_world_size=world_size,
                       node_rank=0, host="h", device_type=device_type)


@pytest.fixture
def fake_group():
    """A 4-rank process group in this one process (collectives do nothing), rank 1."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _sharded_model() -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (4,))
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


# --- 1. the calibration: shard-sized all-reduce, failures recorded, never raised ------------------

def test_the_allreduce_is_sized_by_this_ranks_shard_not_the_global_parameters(fake_group):
    params = list(_sharded_model().parameters())
    total = sum(p.numel() for p in params)  # DTensor numel(): the global size
    assert total == 16 * 8 + 8 + 8 * 4 + 4
    # rank 1 of 4 holds rows 2-3 of the first weight and bias, row 1 of the 4-row ones
    local = 2 * 16 + 2 + 1 * 8 + 1
    sizes = calibrate.grad_sizes(params)
    assert sizes.local_bytes == 4 * local
    assert sizes.unsharded_bytes == 4 * (total - local)
    # plain tensors (DDP) count whole, and nothing is unsharded
    plain = calibrate.grad_sizes([torch.zeros(3, 5), torch.zeros(7)])
    assert (plain.local_bytes, plain.unsharded_bytes) == (4 * 22, 0)


class _Wrapped:
    """What the calibration uses of runtime.wrap.Wrapped."""

    @staticmethod
    def no_sync():
        from contextlib import nullcontext

        return nullcontext()


class _Window:
    @staticmethod
    def fwd_bwd_times() -> list[float]:
        return [0.010, 0.012, 0.011]


def test_the_harness_records_an_allreduce_of_this_ranks_shard(fake_group):
    model = _sharded_model()
    params = [p for p in model.parameters() if p.requires_grad]
    cleared = []
    record = calibrate.comm_record(_Window(), _Wrapped(), lambda: None, lambda: cleared.append(1),
                                   params, _ctx())
    local = sum(p.to_local().numel() for p in params) * 4
    assert record["allreduce_bytes"] == local < sum(p.numel() for p in params) * 4
    assert record["sync_steps"] == 3 and record["nosync_passes"] >= 1 and cleared
    assert "error" not in record and "skipped" not in record


def test_an_out_of_memory_in_the_sync_off_pass_is_recorded_not_raised(fake_group):
    cleared = []

    def replay() -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    record = calibrate.comm_record(_Window(), _Wrapped(), replay, lambda: cleared.append(1),
                                   [torch.zeros(10)], _ctx())
    assert record["kind"] == "comm"
    assert record["error"].startswith("sync-off pass: OutOfMemoryError: CUDA out of memory")
    assert record["skipped"] == ("exposed communication and all-reduce bandwidth not measured: "
                                 "this rank failed (see error)")
    assert not {"exposed_comm_s", "busbw_gb_s", "allreduce_bytes"} & set(record)
    assert cleared  # the failed pass's gradients were dropped


def test_a_failed_benchmark_buffer_keeps_the_exposed_communication(fake_group, monkeypatch):
    def no_room(nbytes: int, device: Any) -> Any:
        raise torch.OutOfMemoryError("no room")

    monkeypatch.setattr(calibrate, "_zeros", no_room)
    record = calibrate.measure([0.02, 0.02], lambda: None, ctx=_ctx(),
                               sizes=calibrate.GradSizes(local_bytes=400, unsharded_bytes=0))
    assert record["exposed_comm_s"] >= 0 and record["nosync_passes"] >= 1
    assert record["error"] == "all-reduce buffer: OutOfMemoryError: no room"
    assert record["skipped"].startswith("all-reduce bandwidth not measured")
    assert "busbw_gb_s" not in record


def test_a_cuda_out_of_memory_frees_the_allocators_cache(monkeypatch):
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    cal = calibrate._Calibration(_ctx())
    cal.cuda = True

    def oom() -> None:
        raise torch.OutOfMemoryError("out of memory")

    assert cal.attempt("sync-off pass", oom) is None and emptied == [1]
    assert cal.attempt("sync-off pass", lambda: 1 / 0) is None and emptied == [1]  # not an OOM
    assert cal.record["error"].startswith("sync-off pass: OutOfMemoryError")  # the first one


def test_a_calibration_that_would_not_fit_is_not_started():
    # CPU: host memory is not checked
    assert calibrate.shortfall(10 * GIB, None) is None
    assert calibrate.shortfall(8 * GIB, 10 * GIB) is None
    short = calibrate.shortfall(int(9.5 * GIB), 10 * GIB)  # beyond the margin
    assert short == "needs about 9.50 GiB of device memory, 10.00 GiB free"


# Two real ranks (gloo) in which one rank alone fails: both must leave the calibration with
# the same collectives behind them, and say so in their records, within seconds.
SCENARIOS = ("none", "pass", "buffer")


def _rank_main(rank: int, init: str, out: Any) -> None:
    import datetime

    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=20))
        ctx = _ctx(world_size=2, rank=rank)
        zeros = calibrate._zeros
        for failing in SCENARIOS:

            def sync_off_pass() -> None:
                if rank == 1 and failing == "pass":
                    raise torch.OutOfMemoryError("out of memory on rank 1")

            def no_room(nbytes: int, device: Any) -> Any:
                raise torch.OutOfMemoryError("no room on rank 1")

            calibrate._zeros = no_room if rank == 1 and failing == "buffer" else zeros  # type: ignore[assignment]
            # shards of different sizes: the benchmark takes the largest, the same on both ranks
            sizes = calibrate.GradSizes(local_bytes=400 if rank == 0 else 396, unsharded_bytes=4)
            record = calibrate.measure([0.01, 0.01], sync_off_pass, ctx=ctx, sizes=sizes)
            # the group is still in step: one more collective completes on both
            t = torch.ones(1)
            dist.all_reduce(t)
            out.put((failing, rank, record, float(t.item())))
    except BaseException:
        out.put(("error", rank, traceback.format_exc(), 0.0))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.distributed
def test_every_rank_takes_the_same_path_when_one_rank_fails(tmp_path):
    mp = multiprocessing.get_context("spawn")
    out = mp.Queue()
    init = f"file://{tmp_path / 'store'}"
    procs = [mp.Process(target=_rank_main, args=(r, init, out)) for r in range(2)]
    for p in procs:
        p.start()
    results: dict[str, dict[int, dict[str, Any]]] = {}
    try:
        for _ in range(2 * len(SCENARIOS)):
            failing, rank, record, total = out.get(timeout=120)
            assert failing != "error", record  # the rank raised: its traceback
            assert total == 2.0
            results.setdefault(failing, {})[rank] = record
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    ok, bad = results["none"][0], results["none"][1]
    assert ok["allreduce_bytes"] == bad["allreduce_bytes"] == 400
    for failing in ("pass", "buffer"):
        ok, bad = results[failing][0], results[failing][1]
        assert "error" not in ok and ok["skipped"].endswith("another rank failed")
        assert bad["error"].startswith({"pass": "sync-off pass", "buffer": "all-reduce buffer"}[failing])
        assert bad["skipped"].endswith("this rank failed (see error)")
        assert "busbw_gb_s" not in ok and "busbw_gb_s" not in bad
        # a failure after the passes keeps what they measured
        assert ("exposed_comm_s" in ok) == (failing == "buffer")


# --- 3. peak memory: reset after warm-up; tensors against tensors ------------------------------

def test_the_peak_is_reset_once_at_the_first_steady_step_on_cuda_only(tmp_path, monkeypatch):
    resets = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: resets.append(1))
    assert peak_reset_step(0, 2) == 3 and peak_reset_step(10, 2) == 13  # a resumed attempt
    recorder = RankRecorder(tmp_path, 0, {"world_size": 1})
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    for device_type, expected in (("cuda", 1), ("cpu", 0)):
        resets.clear()
        window = Window(Clock("cpu"), _ctx(1, 0, device_type), recorder, scaler,
                        torch.device("cpu"), 10, steady_from=peak_reset_step(0, 2))
        seen = []
        for step in range(1, 7):
            window.begin(step)
            seen.append(len(resets))
        assert seen == [0, 0, expected, expected, expected, expected], device_type


def test_a_ranks_peak_is_its_steady_steps_peak(tmp_path):
    run = write_run(tmp_path / "r", world_size=1, steps=6, warmup=2, result=None)
    path = RunPaths(root=run).records(0)
    lines = path.read_text().splitlines()
    # warm-up steps recorded compile autotuning's peak (before the rank reset it)
    lines = [line.replace(f'"peak_mem_bytes":{1 << 28}', f'"peak_mem_bytes":{1 << 30}')
             if '"warmup":true' in line else line for line in lines]
    path.write_text("\n".join(lines) + "\n")
    assert aggregate(run).ranks[0].peak_mem_bytes == 1 << 28


def _profile() -> ModelProfile:
    return ModelProfile(name="m", num_params=100_000_000, bytes_by_dtype={"float32": 400_000_000},
                        num_blocks=8, largest_block_params=10_000_000,
                        activation_bytes_per_sample=50e6, block_input_bytes_per_sample=2e6,
                        flops_fwd_per_sample=1e9)


@pytest.mark.parametrize("kind,world_size", [("fsdp_full", 4), ("ddp", 2), ("fsdp_grad_op", 2)])
def test_the_plans_tensor_part_leaves_out_context_nccl_and_slack(kind, world_size):
    strategy = Strategy(kind=kind, precision="bf16")
    args = dict(micro_batch=4, world_size=world_size,
                shard_group_size=world_size if kind != "ddp" else 1)
    cuda = estimate_memory(_profile(), strategy, device="cuda", **args)
    cpu = estimate_memory(_profile(), strategy, device="cpu", **args)
    # off CUDA the plan counts tensors only: the same tensors, plus the cuBLAS workspaces the
    # caching allocator holds, are the CUDA estimate's tensor part
    assert plan_tensor_bytes(cuda, device="cuda", world_size=world_size) == pytest.approx(
        cpu.total_bytes + CUBLAS_WORKSPACE_BYTES)
    assert plan_tensor_bytes(cpu, device="cpu", world_size=world_size) == cpu.total_bytes
    assert cuda.total_bytes - cpu.total_bytes > 0.75 * GIB  # context 0.5 + NCCL 0.25 + slack


def _plan_json(est: Any, world_size: int) -> dict[str, Any]:
    chosen = {"strategy": {"kind": "fsdp_full", "precision": "bf16"}, "micro_batch": 4,
              "grad_accum": 1, "memory": est.__dict__,
              "time": {"compute_s": 0.1, "comm_total_s": 0.0, "comm_exposed_s": 0.0}}
    return {"plan": {"chosen": chosen, "world_size": world_size}}


def test_cuda_compares_the_plans_tensors_with_torchs_allocated_peak(tmp_path):
    est = estimate_memory(_profile(), Strategy(kind="fsdp_full", precision="bf16"), micro_batch=4,
                          world_size=4, shard_group_size=4, device="cuda")
    tensors = plan_tensor_bytes(est, device="cuda", world_size=4)
    spec = LaunchSpec(workload="w.py", run_id="t", run_dir=str(tmp_path), device="cuda",
                      gpus=4, micro_batch=4,
                      strategy="fsdp_full", precision="bf16")
    block = compare(_plan_json(est, 4), spec, step_time_s=0.1, peak_mem_bytes=int(tensors),
                    device="cuda")
    assert block["available"], block
    assert block["mem_gib"] == pytest.approx(tensors / GIB)
    assert block["mem_total_gib"] == pytest.approx(est.total_gib)
    assert block["mem_ratio"] == pytest.approx(1.0)  # the old total made it read ~0.8
    assert "steady steps" in block["measured_mem_kind"]
    line = prediction_line(block)
    assert f"{tensors / GIB:.2f} GiB predicted" in line
    assert line.endswith(f"with the CUDA context, NCCL buffers and allocator slack the plan "
                         f"expects {est.total_gib:.2f} GiB per rank (what nvidia-smi would show)")
    # on CPU the tensor part is the whole estimate: the line says nothing more
    cpu = compare(_plan_json(est, 4), replace(spec, device="cpu"), step_time_s=0.1,
                  peak_mem_bytes=None, device="cpu")
    assert cpu["mem_gib"] == pytest.approx(cpu["mem_total_gib"]) and "nvidia-smi" not in prediction_line(cpu)


# --- 4. the memory snapshot: Python stacks, a heartbeat while it is written --------------------

def test_the_memory_history_records_python_stacks_only(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda *a, **kw: calls.append((a, kw)))
    profiling.start_memory_history()
    [(args, kwargs)] = calls
    assert kwargs.get("stacks") == "python" and not args
    assert kwargs["enabled"] == "all" and kwargs["max_entries"] == profiling.SNAPSHOT_ENTRIES
    # the keywords torch 2.13 takes (C++ frames would be stacks="all", its default)
    import inspect

    params = inspect.signature(torch.cuda.memory._record_memory_history_impl).parameters
    assert set(kwargs) <= set(params) and params["stacks"].default == "all"


def _beat(run_dir: Path) -> dict[str, Any]:
    return json.loads(RunPaths(root=run_dir).heartbeat(0).read_text())


def test_the_heartbeat_goes_on_while_the_snapshot_is_written(tmp_path, monkeypatch):
    recorder = RankRecorder(tmp_path, 0, {"world_size": 1})
    recorder.add({"kind": "step", "step": 7})
    seen: list[dict[str, Any]] = []

    def slow_dump(path: str) -> None:
        # a slow dump: the caller's thread does nothing else meanwhile. It lasts until three more
        # beats were seen (or 20 s): on a loaded host one beat's file replace can stall for a while,
        # so a fixed length would test the host's scheduler rather than the thread
        deadline = time.monotonic() + 20.0
        while time.monotonic() < deadline:
            time.sleep(0.02)
            seen.append(_beat(tmp_path))
            if seen[-1]["busy_beats"] >= seen[0]["busy_beats"] + 3:
                break
        Path(path).write_bytes(b"snapshot")

    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", slow_dump)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **kw: None)
    record = profiling.dump_memory_snapshot(tmp_path, 0, reason="end of run",
                                            busy=recorder.busy("writing the memory snapshot",
                                                               interval_s=0.02))
    assert record == {"kind": "memory_snapshot", "path": str(RunPaths(root=tmp_path).memory_snapshot(0)),
                      "reason": "end of run"}
    assert all(b["busy"] == "writing the memory snapshot" and b["step"] == 7 for b in seen)
    counts = [b["busy_beats"] for b in seen]
    assert counts == sorted(counts) and counts[-1] >= counts[0] + 3, counts  # it advanced
    assert "busy" not in _beat(tmp_path)  # the thread is gone with the dump


def test_a_failing_dump_ends_its_heartbeat_thread_too(tmp_path, monkeypatch):
    recorder = RankRecorder(tmp_path, 0, {"world_size": 1})

    def broken(path: str) -> None:
        raise RuntimeError("disk full")

    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", broken)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **kw: None)
    record = profiling.dump_memory_snapshot(tmp_path, 0, reason="out of memory",
                                            busy=recorder.busy("writing", interval_s=0.01))
    assert record["path"] is None and record["error"] == "disk full"
    assert "busy" not in _beat(tmp_path)
    import threading

    assert not [t for t in threading.enumerate() if t.name == "dlaunch-busy-beat"]


# --- 5. data wait: what a busy device hid is not waiting -------------------------------------

class _Event:
    """A CUDA event as the clock uses it: recorded, then queried (never synchronised)."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.done = False

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return self.done


def test_exposed_wait_counts_a_fetch_only_when_the_device_had_drained():
    assert exposed_wait(0.3, device_busy=None) == 0.3  # CPU, or nothing queued yet
    assert exposed_wait(0.3, device_busy=True) == 0.0  # hidden behind the previous step
    assert exposed_wait(0.3, device_busy=False) == 0.3  # an upper bound: drained during it


def test_a_fetch_hidden_behind_the_previous_steps_kernels_is_no_data_wait(monkeypatch):
    clock = Clock("cpu")
    clock.cuda = True  # the CUDA branch, with fake events in torch.cuda.Event's place
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    assert clock.exposed_wait(0.2) == 0.2  # the first step: no previous step queued
    start = clock.start()
    _, end = clock.stop(start)  # the previous step's end event
    assert clock.exposed_wait(0.2) == 0.0  # still running when the fetch ended
    end.done = True
    assert clock.exposed_wait(0.2) == 0.2
    # CPU: every fetch is waited for
    assert Clock("cpu").exposed_wait(0.2) == 0.2


def test_the_harness_times_the_loader_not_the_copy(monkeypatch):
    clock = Clock("cpu")
    waits = []
    monkeypatch.setattr(clock, "exposed_wait", lambda s: waits.append(s) or 0.0)

    # the loader's clock is the test's: each loader call takes 0.02 s of it, each blocking copy
    # 0.3 s, so what fetch timed is exact (no wall clock, nothing a loaded host can move)
    now = [0.0]
    monkeypatch.setattr(loader, "time", SimpleNamespace(perf_counter=lambda: now[0]))

    def slow_batches():
        while True:
            now[0] += 0.02
            yield torch.ones(2)

    copies = []

    def slow_copy(batch: Any, device: Any) -> Any:
        copies.append(batch)
        now[0] += 0.3
        return batch

    monkeypatch.setattr(loader, "to_device", slow_copy)
    held, wait = loader.fetch(slow_batches(), 2, torch.device("cpu"), clock)
    assert len(held) == 2 == len(copies) and wait == 0.0
    [fetch_s] = waits
    assert fetch_s == pytest.approx(0.04)  # two loader calls; the blocking copies (0.3 s each) left out

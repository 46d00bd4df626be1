"""runtime.live_bytes: peak live tensor bytes from the CPU allocator's own record, which sees
what a dispatch mode cannot (storages resized in place as FSDP2 frees and re-gathers its
unsharded parameters, DTensor shards, buffers compiled code allocates). Compiled and FSDP steps
are measured end to end in tests/integration/test_compile.py and benchmarks/memory_truth.py."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from launcher.runtime.live_bytes import LiveBytes, StepSampler, running_peak, storage_bytes

MB = 1 << 20


def test_running_peak_is_the_largest_sum_in_time_order():
    assert running_peak([(3, -5), (1, 10), (2, 4), (4, 2)]) == 14
    assert running_peak([]) == 0


def test_existing_storages_count_once_per_storage():
    a = torch.zeros(MB // 4)  # 1 MiB
    assert storage_bytes([a, a[10:], a.view(2, -1), None]) == MB


def test_allocations_and_frees_inside_the_span_set_the_peak():
    keep = torch.zeros(MB // 4)
    with LiveBytes() as live:
        live.add_existing([keep])
        x = torch.ones(2 * MB // 4)  # +2 MiB
        y = x * 2  # +2 MiB: 5 MiB live
        del x, y
        z = torch.ones(MB // 4)  # 2 MiB live
        del z
    assert 5 * MB <= live.peak < 5 * MB + 64 * 1024


def test_a_storage_freed_and_regrown_in_place_is_seen():
    # FSDP2 frees an unsharded parameter with storage.resize_(0) and re-gathers into it with
    # resize_(n): no op creates or frees a tensor, so a dispatch mode never saw either
    with LiveBytes() as live:
        t = torch.empty(4 * MB // 4)  # 4 MiB
        t.untyped_storage().resize_(0)  # freed
        u = torch.empty(3 * MB // 4)  # 3 MiB: the peak stays 4
        t.untyped_storage().resize_(2 * MB)  # regrown: 5 MiB
        del u
    assert 5 * MB <= live.peak < 5 * MB + 64 * 1024


def test_every_strategy_is_sampled_on_cpu_and_a_running_profiler_is_left_alone():
    model = torch.nn.Linear(64, 64)
    opt = SimpleNamespace(state={})  # only its state is read; a real optimizer imports Dynamo (2 s)
    sampler = StepSampler.for_rank(device_type="cpu", start=0, warmup_steps=2, steps=5,
                                   module=model, optimizer=opt)
    assert sampler.step == 2
    record: dict[str, object] = {}
    with LiveBytes():  # a profiler already recording (the run's --profile): torch's do not nest
        sampler.begin(2)
        model(torch.randn(8, 64)).sum().backward()
        sampler.end(2, record)
    assert "live_peak_bytes" not in record


def test_the_profilers_own_lines_are_dropped_and_the_steps_output_kept(capfd):
    import os

    keep = torch.zeros(MB // 4)
    with LiveBytes():
        os.write(2, b"the rank's own line\n")
        del keep  # made before the span: c10's allocator notes the free on stderr
    err = capfd.readouterr().err
    assert "the rank's own line" in err
    assert "unknown size" not in err and "SyncActivityProfilerHandler" not in err

"""runtime.stream.RankStream: a stream split over data-parallel ranks and DataLoader workers as
DistributedSampler splits a map-style dataset, and resumed by skipping micro-batches."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from launcher.runtime.stream import RankStream


class Numbers(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


def _batches(dp_size: int, dp_rank: int, *, workers: int = 0, skip: int = 0, n: int = 48) -> list[list[int]]:
    stream = RankStream(Numbers(n), dp_size=dp_size, dp_rank=dp_rank, micro_batch=4, skip_batches=skip)
    return [b.tolist() for b in DataLoader(stream, batch_size=4, drop_last=True, num_workers=workers)]


def _sampler_batches(dp_size: int, dp_rank: int, n: int = 48) -> list[list[int]]:
    data = list(range(n))
    sampler = DistributedSampler(data, num_replicas=dp_size, rank=dp_rank, shuffle=False, drop_last=True)
    return [b.tolist() for b in DataLoader(data, batch_size=4, sampler=sampler, drop_last=True)]


def test_each_rank_gets_the_map_style_micro_batches():
    for rank in range(3):
        assert _batches(3, rank) == _sampler_batches(3, rank)
    # the ranks' batches at a step make up one process's batch: nothing lost, nothing twice
    firsts = sorted(x for rank in range(3) for x in _batches(3, rank)[0])
    assert firsts == list(range(12))


def test_workers_keep_the_rank_s_order():
    assert _batches(2, 1, workers=2) == _batches(2, 1) == _sampler_batches(2, 1)


def test_a_resume_skips_the_trained_micro_batches():
    assert _batches(2, 0, skip=3) == _batches(2, 0)[3:]
    assert _batches(2, 0, skip=3, workers=2) == _batches(2, 0)[3:]


def test_a_short_tail_is_dropped():
    assert _batches(1, 0, n=10) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert torch.utils.data.get_worker_info() is None

"""A workload's IterableDataset, split over the data-parallel ranks and DataLoader workers the
way DistributedSampler splits a map-style dataset, and resumable.

Data-parallel rank d of D takes items d, d + D, d + 2D, ... of the stream (DistributedSampler's
order without shuffling), so the union of the ranks' micro-batches at a step is the batch one
process would see, as with a map-style dataset holding the stream's items. Inside a rank,
DataLoader worker w of W takes that rank's micro-batches w, w + W, ... (the DataLoader takes
batches from its workers in turn, so the rank sees them in order). A resume at step s skips the
first s x micro-batch x accumulation items of the rank's stream by reading them (a stream cannot
seek). Each worker reads the whole stream and keeps its share: a stream that is expensive to
produce should be sharded by the workload itself and given as a map-style dataset.

Shuffling does not apply: the stream's order is the order.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info


class RankStream(IterableDataset[Any]):
    """The items of `dataset` data-parallel rank `dp_rank` of `dp_size` trains on, from
    micro-batch `skip_batches` on, for the DataLoader worker iterating it."""

    def __init__(self, dataset: IterableDataset[Any], *, dp_size: int, dp_rank: int,
                 micro_batch: int, skip_batches: int = 0) -> None:
        super().__init__()
        self.dataset, self.dp_size, self.dp_rank = dataset, dp_size, dp_rank
        self.micro_batch, self.skip_batches = micro_batch, skip_batches

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        mine = itertools.islice(iter(self.dataset), self.dp_rank, None, self.dp_size)
        batch = 0
        while True:
            chunk = list(itertools.islice(mine, self.micro_batch))
            if len(chunk) < self.micro_batch:  # the stream ended: a short batch is dropped
                return
            if batch >= self.skip_batches and (batch - self.skip_batches) % workers == worker:
                yield from chunk
            batch += 1

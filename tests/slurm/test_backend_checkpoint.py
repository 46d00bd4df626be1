"""launcher.runtime.checkpoint (the resume half of preemption/requeue), without a cluster: an
interrupted-and-resumed run ends with exactly the uninterrupted run's parameters and losses,
in one process and in two gloo ranks with DDP."""

from __future__ import annotations

import gc
import os
import socket
from pathlib import Path

import torch

from launcher.runtime import checkpoint


def _model() -> "torch.nn.Module":
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                               torch.nn.Linear(16, 2))


def _batch(step: int, rank: int) -> tuple:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g)


def _train(model, opt, steps: range, rank: int = 0) -> list[float]:
    losses = []
    for step in steps:
        x, y = _batch(step, rank)
        loss = torch.nn.functional.cross_entropy(model(x), y)  # dropout: uses the RNG stream
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _run(ckpt: Path | None, *, stop_at: int | None, total: int, wrap=lambda m: m, rank: int = 0):
    """Train `total` steps; with `stop_at`, save there, rebuild everything fresh and resume."""
    torch.manual_seed(0)
    model = wrap(_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if stop_at is None:
        return _train(model, opt, range(1, total + 1), rank), model
    losses = _train(model, opt, range(1, stop_at + 1), rank)
    checkpoint.save(stop_at, model, opt, ckpt, extra={"data_position": stop_at})
    torch.manual_seed(123)  # a fresh process: other init, other RNG position
    model = wrap(_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step, meta = checkpoint.load(model, opt, ckpt)
    assert step == stop_at and meta["data_position"] == stop_at
    return losses + _train(model, opt, range(step + 1, total + 1), rank), model


def test_resume_in_one_process_equals_uninterrupted(tmp_path: Path):
    full, m_full = _run(None, stop_at=None, total=8)
    resumed, m_res = _run(tmp_path / "ck", stop_at=5, total=8)
    assert resumed == full  # same RNG stream (dropout) and optimizer state: bit-identical
    for a, b in zip(m_full.state_dict().values(), m_res.state_dict().values()):
        assert torch.equal(a, b)


def test_latest_skips_partial_and_prunes(tmp_path: Path):
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    for step in (2, 4, 6):
        checkpoint.save(step, model, opt, tmp_path, keep=2)
    (tmp_path / "step-000008.partial").mkdir()  # a job killed while saving
    assert checkpoint.complete_steps(tmp_path) == [4, 6]
    assert checkpoint.latest(tmp_path) == 6
    assert checkpoint.load(model, opt, tmp_path / "none") is None


def _ddp_compare(rank: int, ckpt: str) -> str:
    from torch.nn.parallel import DistributedDataParallel as DDP

    full, m_full = _run(None, stop_at=None, total=6, wrap=DDP, rank=rank)
    resumed, m_res = _run(Path(ckpt), stop_at=3, total=6, wrap=DDP, rank=rank)
    same = resumed == full and all(torch.equal(a, b) for a, b in
                                   zip(m_full.state_dict().values(), m_res.state_dict().values()))
    return "same" if same else f"differ {full} {resumed}"


def _ddp_worker(rank: int, world: int, port: int, ckpt: str, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        # a DDP reducer that outlives its process group, or a rank that closes its gloo pairs
        # while the other still uses them, aborts the process ("terminate called without an
        # active exception", 5 of 24 runs): the models live only inside _ddp_compare, their
        # reference cycles are collected here, and both ranks meet before either tears down
        Path(out, f"rank{rank}").write_text(_ddp_compare(rank, ckpt))
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_resume_with_ddp_on_two_gloo_ranks(tmp_path: Path):
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ddp_worker, args=(2, port, str(tmp_path / "ck"), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        assert (tmp_path / f"rank{rank}").read_text() == "same"
    assert checkpoint.complete_steps(tmp_path / "ck") == [3]
    assert sorted(p.name for p in (tmp_path / "ck" / "step-000003").glob("rng-*.pt")) == ["rng-0.pt", "rng-1.pt"]

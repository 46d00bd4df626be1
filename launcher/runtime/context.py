"""The rank's view of the job, read from the environment torchrun (or SLURM) sets, and its tie
to the agent that started it (`watch_parent`: a rank never outlives torchrun).

Torch-free at module level: a rank reads who it is here before its recorder exists (see
runtime/__init__). `device` and `init_distributed` import torch once the rank's door has loaded
it; `shutdown_distributed` never loads it. Never imports cli, backends, jobs or report.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

PARENT_POLL_S = 1.0
# after its agent died: SIGTERM lets the rank write its summary; a rank blocked in a
# collective never runs that handler, so SIGKILL follows
ORPHAN_GRACE_S = 5.0


@dataclass(frozen=True, kw_only=True)
class RankContext:
    """Who this process is within the job."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    host: str
    device_type: str  # cuda | cpu

    @property
    def is_distributed(self) -> bool:
        """True when more than one rank takes part."""
        return self.world_size > 1

    def device(self) -> torch.device:
        """The torch.device this rank computes on."""
        # torch is loaded by now (the rank's door): this module must not load it (see above)
        import torch

        return torch.device("cuda", self.local_rank) if self.device_type == "cuda" else torch.device("cpu")


def from_env(device_type: str, env: dict[str, str] | None = None) -> RankContext:
    """Read RANK / LOCAL_RANK / WORLD_SIZE / GROUP_RANK; defaults describe a single process."""
    e = os.environ if env is None else env
    return RankContext(
        rank=int(e.get("RANK", 0)), local_rank=int(e.get("LOCAL_RANK", 0)),
        world_size=int(e.get("WORLD_SIZE", 1)), local_world_size=int(e.get("LOCAL_WORLD_SIZE", 1)),
        # torchrun's c10d rendezvous numbers nodes by host name and pid, not --node-rank; the
        # SLURM backend passes the node id it logs under, so rank files and logs agree
        node_rank=int(e.get("DLAUNCH_NODE_RANK", e.get("GROUP_RANK", e.get("SLURM_NODEID", 0)))),
        # fake SLURM nodes share one host; the node name tells them apart
        host=e.get("SLURMD_NODENAME") or socket.gethostname(),
        device_type=device_type,
    )


def process_group_kwargs(ctx: RankContext, *, timeout_s: float) -> dict[str, Any]:
    """`init_process_group`'s arguments: nccl bound to this rank's GPU (device_id: the
    communicator starts at once, on the right device), or gloo; the collective timeout (a hung
    collective must end long before the 30-minute default)."""
    kwargs: dict[str, Any] = {"backend": "nccl" if ctx.device_type == "cuda" else "gloo",
                              "timeout": timedelta(seconds=timeout_s)}
    if ctx.device_type == "cuda":
        kwargs["device_id"] = ctx.device()
    return kwargs


def needs_process_group(ctx: RankContext, *, mesh: bool) -> bool:
    """Whether this rank starts a process group: with several ranks, or a device mesh (FSDP), for
    which `init_device_mesh` would start one itself, with neither the timeout nor the device id."""
    return ctx.is_distributed or mesh


def init_distributed(ctx: RankContext, *, timeout_s: float = 1800.0, mesh: bool = False) -> None:
    """Pick the device and start the process group (`needs_process_group`; `wrap.uses_device_mesh`)."""
    # torch is loaded by now (the rank's door): this module must not load it (see above)
    import torch
    import torch.distributed as dist

    if ctx.device_type == "cuda":
        torch.cuda.set_device(ctx.local_rank)
    if needs_process_group(ctx, mesh=mesh) and not dist.is_initialized():
        kwargs = process_group_kwargs(ctx, timeout_s=timeout_s)
        dist.init_process_group(**kwargs)
        log.debug("rank %d: process group %s up", ctx.rank, kwargs["backend"])


def shutdown_distributed() -> None:
    """Destroy the process group if one is up. Safe in every `finally`: it never loads torch (a
    rank that ended before torch loaded has no group), and a teardown failure is only logged."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception as e:
        log.debug("process group teardown failed: %s", e)


def watch_parent() -> None:
    """End this rank when the process that started it (torchrun's agent) is gone: an agent killed
    with SIGKILL cannot stop its ranks, and an orphan would go on training (holding its device)."""

    parent = os.getppid()

    def loop() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        log.warning("the agent (pid %d) that started this rank is gone; stopping", parent)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(ORPHAN_GRACE_S)
        os.kill(os.getpid(), signal.SIGKILL)

    # not in the rank's entry module: the stack dump of a hung rank finds its main thread there
    threading.Thread(target=loop, name="dlaunch-parent-watch", daemon=True).start()

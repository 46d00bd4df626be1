"""Common misfits between a script and the machine it runs on, told in one line each.

Outside scripts are usually written for GPUs: launched unchanged on a CPU host they fail in a
handful of well-known ways. The rank's own error (or its stderr's last lines) is matched
against them, and the failure line of the run summary gains what to change.

Pure (no torch, no I/O). Never imports report, jobs, backends, cli or runtime.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Misfit:
    """A known failure: any of its `signs` in the error text, and what to change."""

    name: str
    signs: tuple[str, ...]
    fix: str


MISFITS = (
    Misfit(name="NCCL without CUDA",
           signs=("doesn't have NCCL built in", "NCCL is not available",
                  "ProcessGroupNCCL is only supported with GPUs"),
           fix="the script asks for the NCCL backend, which needs CUDA GPUs: on CPU use "
               "dist.init_process_group('gloo') (or backend='cpu:gloo,cuda:nccl' for both)"),
    Misfit(name="CUDA device without a GPU",
           signs=("_cuda_setDevice", "No CUDA GPUs are available", "Torch not compiled with CUDA enabled",
                  "Found no NVIDIA driver", "invalid device ordinal"),
           fix="the script uses a CUDA device (torch.cuda.set_device, .cuda(), device='cuda') but this run has no "
               "GPU: guard it with torch.cuda.is_available() and use torch.device('cpu') otherwise"),
    Misfit(name="device_ids on CPU DDP", signs=("device_ids and output_device arguments only work with",),
           fix="DistributedDataParallel got device_ids for a CPU model: pass device_ids only for a GPU model "
               "(DistributedDataParallel(model) on CPU)"),
)


def find_misfit(texts: Iterable[str | None]) -> Misfit | None:
    """The first known misfit whose sign appears in any of `texts` (errors, log lines)."""
    joined = "\n".join(t for t in texts if t)
    return next((m for m in MISFITS if any(s in joined for s in m.signs)), None)

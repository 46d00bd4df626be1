"""What the meta-device profile cannot see, measured on tiny real CPU tensors instead: the
optimizer's persistent state per parameter for the memory model (`optimizer_state`: SGD with
momentum 4 B, AdamW 8 B, SGD without momentum 0), and whether a profile that failed on the meta
device fails on a real CPU batch too (`meta_error`: a bug in the workload, or only not meta-safe).

Never imports cli, backends, jobs, runtime or report; torch only inside functions (only a profile
missing from the cache needs it).
"""

from __future__ import annotations

import logging
from typing import Any

from launcher.errors import WorkloadError
from launcher.workload import Workload, optimizer_kwargs

log = logging.getLogger(__name__)

# the CPU check of a failed meta profile builds the model for real: only below this size
CPU_CHECK_MAX_PARAM_BYTES = 2 * 1024**3
CPU_BATCH = 2  # samples in the CPU check's batch
PROBE_NUMEL = 8  # elements of the tensor an optimizer's state is measured on


def _probe_state_bytes(cls: type, settings: dict[str, Any]) -> float:
    """Persistent state bytes per element after one step of `cls(settings)` on a tiny fp32
    CPU tensor: tensors the size of the parameter (momentum, exp_avg), not scalar counters."""
    import torch

    probe = torch.zeros(PROBE_NUMEL, requires_grad=True)
    optimizer = cls([probe], **optimizer_kwargs(cls, settings))
    probe.grad = torch.ones(PROBE_NUMEL)
    optimizer.step()
    return sum(t.numel() * t.element_size() for state in optimizer.state.values()
               for t in state.values()
               if isinstance(t, torch.Tensor) and t.numel() == PROBE_NUMEL) / PROBE_NUMEL


def optimizer_state(workload: Workload, model: Any, num_params: int) -> tuple[str, float, bool | None]:
    """The workload's optimizer ("SGD (make_optimizer)", "AdamW (default)"), its persistent state
    in bytes per model parameter and whether it steps fused (None: dlaunch's default optimizer):
    built on the (meta) model, so its param groups are the workload's, each group's settings
    (momentum, amsgrad) stepped once on a real probe; parameters it does not train hold none. An
    optimizer that cannot be probed counts as AdamW's 8 B."""
    optimizer = workload.make_optimizer(model)
    cls = type(optimizer)
    default = not hasattr(workload.module, "make_optimizer")
    fused = None if default else any(bool(g.get("fused")) for g in optimizer.param_groups)
    total = 0.0
    try:
        for group in optimizer.param_groups:
            settings = {k: v for k, v in group.items() if k != "params"}
            total += _probe_state_bytes(cls, settings) * sum(p.numel() for p in group["params"])
    except Exception as e:
        log.warning("optimizer %s could not be probed on CPU (%s: %s); its state is assumed to "
                    "be AdamW's 8 B/param", cls.__name__, type(e).__name__, e)
        return f"{cls.__name__} (assumed like AdamW)", 8.0, fused
    return f"{cls.__name__} ({'default' if default else 'make_optimizer'})", total / max(1, num_params), fused


def _first_line(workload: Workload, e: BaseException) -> str:
    """The error in one line, without the "workload NAME: " the caller's message starts with."""
    text = str(e) if isinstance(e, WorkloadError) else f"{type(e).__name__}: {e}"
    text = text.removeprefix(f"workload {workload.path.name}: ")
    return next((line.strip() for line in text.splitlines() if line.strip()), type(e).__name__)


def _cpu_failure(workload: Workload, meta_model: Any) -> BaseException | None:
    """Run the profile's call (build_model, then loss_fn on micro-batch 2 of the real dataset)
    on the CPU; the exception it raises, or None when it works there. Skipped (None) for a
    model too big to build for real, whose meta size is known."""
    import torch
    from torch.utils.data import default_collate

    if meta_model is not None:
        size = sum(p.numel() * p.element_size() for p in meta_model.parameters())
        if size > CPU_CHECK_MAX_PARAM_BYTES:
            return None
    try:
        with torch.device("cpu"):
            model = workload.build_model()
        workload.loss_fn(model, default_collate(workload.first_samples(CPU_BATCH)))
    except Exception as e:
        return e
    return None


def meta_error(workload: Workload, meta_model: Any, e: Exception) -> WorkloadError:
    """The one-line error of a failed meta profile: a bug if it fails on CPU too, else how to be meta-safe."""
    cpu = _cpu_failure(workload, meta_model)
    if cpu is not None:
        return WorkloadError(f"workload {workload.path.name} fails on CPU too: {_first_line(workload, cpu)} "
                             "(not a meta-device problem: fix the workload or its options)")
    return WorkloadError(f"workload {workload.path.name} fails only on the meta device "
                         f"({_first_line(workload, e)}); make build_model and loss_fn meta-safe: no "
                         ".item()/.tolist(), no data-dependent shapes, no explicit device=")

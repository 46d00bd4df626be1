"""The workload's optional `evaluate(model, cfg)`, run by the harness every `--eval-every` steps.

Every rank calls it at the same step (FSDP's all-gathers need them all), in eval mode and
without gradients. Each metric is then averaged over the ranks that returned it (one
`all_gather_object`: ranks evaluating different shards of a held-out set get the global mean,
and ranks returning different names cannot mismatch a tensor collective).

Records: the step record of an evaluated step carries `eval` {name: value} and `eval_s`; the
rank summary carries the last one as `eval` {step, name: value}.

Never imports cli, backends, jobs or report; torch at module level (see runtime/__init__).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from launcher.errors import WorkloadError
from launcher.runspec import LaunchSpec
from launcher.runtime.context import RankContext
from launcher.workload import Workload


def check(workload: Workload, spec: LaunchSpec) -> None:
    """--eval-every on a workload without `evaluate`: a WorkloadError before anything is built."""
    if spec.eval_every and not workload.has_evaluate:
        raise WorkloadError(f"--eval-every {spec.eval_every}: workload {workload.path.name} "
                            "defines no evaluate(model, cfg) -> dict[str, float]")


def due(step: int, spec: LaunchSpec, workload: Workload) -> bool:
    """Evaluate after optimizer step `step` (the same answer on every rank)."""
    return spec.eval_every > 0 and step % spec.eval_every == 0 and workload.has_evaluate


def evaluate(workload: Workload, module: torch.nn.Module, ctx: RankContext) -> tuple[dict[str, float], float]:
    """Collective: the workload's metrics averaged over ranks, and the seconds it took."""
    t0 = time.perf_counter()
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            mine = workload.evaluate(module)
    finally:
        module.train(was_training)
    every = [mine]
    if ctx.is_distributed:
        every = [{} for _ in range(ctx.world_size)]
        dist.all_gather_object(every, mine)
    names = sorted({k for metrics in every for k in metrics})
    mean = {k: sum(m[k] for m in every if k in m) / sum(1 for m in every if k in m) for k in names}
    return mean, time.perf_counter() - t0

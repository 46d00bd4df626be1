"""Would torch.compile take the workload whole? Dynamo's explain of one forward, on the meta device.

`check_compile` builds the model on the meta device and runs `torch._dynamo.explain` over one
forward at micro-batch 1 of what the runtime compiles (runtime/wrap.py, runtime/compiling.py): the
model's `forward` (one process and DDP, before DDP wraps it) and the `forward` of one block of each
distinct structure (FSDP2 compiles block by block before `fully_shard`: a whole-model graph would
break in FSDP's block loop). It counts each one's graphs and graph breaks and keeps the first
break's reason and workload line. Explain's backend only records the graphs (no Inductor, no C++ or
Triton compiler), so it runs on any planning host; a model of identical blocks is traced through
its first block only, so even 70B shapes take seconds. Cached with the profile, per workload file,
arguments and torch version (`resolve.cached_compile_check`).

What it cannot see: Inductor or Triton failures on the GPU itself, recompilations from shapes that
change between steps (the harness's batches keep one shape: drop_last), and breaks that depend on
real values (data-dependent Python on tensors fails the meta profile before this runs).

Never imports cli, backends, jobs, runtime or report; torch only inside functions (only a check
missing from the cache needs it).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.errors import PlanError, WorkloadError
from launcher.plan.blocks import first_blocks, repeated_container, signature
from launcher.plan.profile_passes import meta_batch
from launcher.specs import DDP_KINDS, check
from launcher.workload import Workload

log = logging.getLogger(__name__)

# bump when `check_compile` traces differently, so old cache entries are ignored
COMPILE_PROBE_FORMAT = 1
# a break reason or error is cut to this many characters
REASON_CHARS = 300


@dataclass(frozen=True, kw_only=True)
class CompileCheck:
    """What Dynamo made of one forward of the model and of its blocks (FSDP's units): graphs, breaks, the first."""

    model_graphs: int
    model_breaks: int
    model_break: str = ""  # the first break: Dynamo's reason and the workload line it is on
    blocks_traced: int = 0  # distinct blocks traced (0: the workload declares none)
    block_graphs: int = 0
    block_breaks: int = 0
    block_break: str = ""
    error: str = ""  # Dynamo raised while tracing (one line): the trace says nothing
    traced_s: float = 0.0  # how long the trace took

    def __post_init__(self) -> None:
        for name in ("model_graphs", "model_breaks", "blocks_traced", "block_graphs", "block_breaks", "traced_s"):
            check(getattr(self, name) >= 0, PlanError, f"compile check: {name} must be >= 0, got {getattr(self, name)}")

    def per_block(self, kind: str) -> bool:
        """True when strategy `kind` compiles block by block (FSDP2 with declared blocks)."""
        return kind not in DDP_KINDS and self.blocks_traced > 0

    def breaks(self, kind: str) -> tuple[int, str]:
        """The graph breaks where strategy `kind` compiles, and the first one's description."""
        if self.per_block(kind):
            return self.block_breaks, self.block_break
        return self.model_breaks, self.model_break

    def traced(self, kind: str) -> str:
        """What was traced for `kind`: 'the model's forward' / 'the forward of each block'."""
        if self.per_block(kind):
            return "one forward of each block" if self.blocks_traced > 1 else "one forward of a block"
        return "one forward of the model"


def _cut(text: str) -> str:
    return text if len(text) <= REASON_CHARS else text[:REASON_CHARS - 3] + "..."


def _lines(text: str) -> tuple[list[str], str]:
    """`text`'s non-empty lines, stripped, and Dynamo's "Explanation:" line ("" without one)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines, next((x[len("Explanation:"):].strip() for x in lines if x.startswith("Explanation:")), "")


def _one_line(e: BaseException) -> str:
    """The exception's type and first line, with Dynamo's "Explanation:" line when it has one."""
    lines, explain = _lines(str(e))
    text = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
    return _cut(f"{text}; {explain}" if explain else text)


def describe_break(reason: str, frames: list[tuple[str, int, str]], workload_file: str) -> str:
    """One line for a graph break: Dynamo's headline and explanation, and where it is (the
    innermost frame in the workload's file, else the innermost frame): `(gpt.py:18 `print(x)`)`."""
    lines, explain = _lines(reason)
    head = lines[0] if lines else "graph break"
    text = f"{head}: {explain}" if explain else head
    mine = [f for f in frames if f[0] == workload_file] or frames
    if mine:
        file, lineno, line = mine[-1]
        text += f" ({Path(file).name}:{lineno}" + (f" `{line.strip()}`)" if line else ")")
    return _cut(text)


def _explained(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], workload_file: str) -> tuple[int, int, str]:
    """(graphs, breaks, first break) of `fn(*args, **kwargs)` under `torch._dynamo.explain`. Explain
    keeps a break's reason only when a graph ends there: a break before the first op (a `print` on a
    forward's first line) leaves none. Dynamo's `graph_break` counter counts every break, so the
    count is the larger of the two, and such a break is named from the counter (without its line)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    counters["graph_break"].clear()
    out = torch._dynamo.explain(fn)(*args, **kwargs)
    counted = dict(counters["graph_break"])
    reasons = list(out.break_reasons)
    first = ""
    if reasons:
        stack = [(f.filename, f.lineno or 0, f.line or "") for f in reasons[0].user_stack]
        first = describe_break(str(reasons[0].reason), stack, workload_file)
    elif counted:
        first = describe_break(str(next(iter(counted))), [], workload_file)
    return int(out.graph_count), max(len(reasons), sum(counted.values())), first


class _Captured(Exception):
    """Ends the capturing forward once every input is held."""


def _inputs(workload: Workload, model: Any, targets: list[Any]) -> dict[int, tuple[Any, Any]]:
    """The (args, kwargs) each of `targets` is first called with in a micro-batch-1 meta forward of `loss_fn`."""
    calls: dict[int, tuple[Any, Any]] = {}

    def hook(module: Any, args: Any, kwargs: Any) -> None:
        calls.setdefault(id(module), (args, kwargs))
        if len(calls) == len(targets):
            raise _Captured

    handles = [t.register_forward_pre_hook(hook, with_kwargs=True) for t in targets]
    try:
        with contextlib.suppress(_Captured):
            workload.loss_fn(model, meta_batch(workload, 1))
    finally:
        for h in handles:
            h.remove()
    return calls


def check_compile(workload: Workload) -> CompileCheck:
    """Trace one forward of `workload`'s model (and of each distinct block) with Dynamo on the meta
    device; a workload Dynamo cannot trace gives a check with `error` set, not an exception."""
    import torch
    import torch._dynamo

    t0 = time.perf_counter()
    file = str(workload.path)
    model_graphs = model_breaks = block_graphs = block_breaks = traced = 0
    model_break = block_break = error = ""
    distinct: dict[Any, Any] = {}  # one block of each structure
    try:
        with torch.device("meta"):
            model = workload.build_model()
        blocks = workload.blocks(model)
        for b in blocks:
            distinct.setdefault(signature(b), b)
        container = repeated_container(model, blocks)
        with first_blocks(container, 1) if container is not None else contextlib.nullcontext():
            calls = _inputs(workload, model, [model, *distinct.values()])
            if id(model) not in calls:
                raise WorkloadError(f"loss_fn never called the model built by build_model "
                                    f"(no forward to trace in {workload.path.name})")
            args, kwargs = calls[id(model)]
            model_graphs, model_breaks, model_break = _explained(model.forward, args, kwargs, file)
        for block in distinct.values():
            if id(block) not in calls:
                continue  # never called by the forward: nothing to compile
            args, kwargs = calls[id(block)]
            graphs, breaks, first = _explained(block.forward, args, kwargs, file)
            traced += 1
            block_graphs += graphs
            block_breaks += breaks
            block_break = block_break or first
    except Exception as e:  # Dynamo (or the workload under it) failed: the plan says why
        error = _one_line(e)
        log.debug("Dynamo could not trace %s: %s", workload.path.name, error)
    finally:
        torch._dynamo.reset()
    return CompileCheck(model_graphs=model_graphs, model_breaks=model_breaks, model_break=model_break,
                        blocks_traced=0 if error else traced, block_graphs=block_graphs,
                        block_breaks=block_breaks, block_break=block_break, error=error,
                        traced_s=round(time.perf_counter() - t0, 3))


__all__ = ["CompileCheck", "check_compile", "describe_break", "COMPILE_PROBE_FORMAT"]

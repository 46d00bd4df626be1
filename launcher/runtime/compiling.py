"""torch.compile inside a rank: how the model is compiled, what happens when that fails, and
what it cost (graphs, graph breaks, recompilations).

Compilation is lazy, so a failure (no C++ compiler, an unsupported op under `fullgraph=True`, an
Inductor bug) surfaces in the first forward or backward. `CompileGuard` runs those first uses:
by default a compile error switches Dynamo to eager (`torch.compiler.set_stance("force_eager")`,
which keeps every wrapper in place) and the same micro-batches run again; under
`--compile-strict` it fails the rank.

Never imports cli, backends, jobs or report; torch at module level, Dynamo's modules (1.4 s of
imports) only in the functions that run once something was compiled (see runtime/__init__).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from launcher.errors import DlaunchError
from launcher.specs import Strategy

T = TypeVar("T")
# at most this many graph-break / recompile reasons are kept in the rank file
MAX_REASONS = 3
REASON_CHARS = 400


class CompileFailed(DlaunchError):
    """torch.compile failed and the run asked for no eager fallback (--compile-strict)."""

    exit_code = 1


def compile_forward(module: torch.nn.Module, strategy: Strategy) -> None:
    """Compile `module.forward` in place (fullgraph under --compile-strict): a DDP rank's model
    (before DDP wraps it), one process's model, or one FSDP unit. In place, not
    `torch.compile(module)`: parameter names keep no `_orig_mod.` prefix and module hooks (FSDP2's
    all-gathers) stay eager. `forward`, not `Module.compile()`: Dynamo skips the `_call_impl` of
    torch.nn containers (an `nn.Sequential` root compiled nothing, silently, in torch 2.13). Under
    DDP, Dynamo's DDP optimizer splits the graph at bucket boundaries; compiling the DDP wrapper
    instead breaks it at DDP's bookkeeping (3 breaks measured) and fails under fullgraph=True.
    The planner traces these same forwards (plan/compile_probe.py): keep them in step."""
    module.forward = torch.compile(module.forward, mode=strategy.compile_mode, fullgraph=strategy.compile_strict)


def one_line(e: BaseException) -> str:
    """The exception's type and first message line, plus Dynamo's "Explanation:" line and first
    user-code location ("RuntimeError when making fake tensor call" alone names no op)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    text = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
    explain = next((x[len("Explanation:"):].strip() for x in lines if x.startswith("Explanation:")), "")
    if explain:
        text += f"; {explain}"
    if "from user code:" in lines:
        where = lines[lines.index("from user code:") + 1:][:1]
        if where and where[0].startswith("File "):
            text += f" [{where[0]}]"
    return _clipped(text)


def is_compile_error(e: BaseException) -> bool:
    """True for errors raised by Dynamo / AOTAutograd / Inductor rather than by the model."""
    # deferred: Dynamo is loaded only where something compiled (see runtime/__init__)
    import torch._dynamo.exc as dexc

    if isinstance(e, dexc.TorchDynamoException):
        return True
    mod = type(e).__module__ or ""
    return mod.startswith(("torch._dynamo", "torch._inductor", "torch._functorch"))


class CompileGuard:
    """Runs the first uses of a compiled model; falls back to eager on a compile error."""

    def __init__(self, *, compiled: bool, strict: bool, rank: int) -> None:
        self.watching, self.strict, self.rank = compiled, strict, rank
        self.fallback: str | None = None

    def run(self, fn: Callable[[], T], reset: Callable[[], None]) -> T:
        """`fn()`; on a compile error (unless strict) Dynamo goes eager for the rest of the process,
        `reset()` drops partial gradients and `fn()` runs again (the caller keeps its inputs)."""
        if not self.watching:
            return fn()
        try:
            return fn()
        except Exception as e:
            if not is_compile_error(e):
                raise
            reason = one_line(e)
            if self.strict:
                raise CompileFailed(f"torch.compile failed under --compile-strict: {reason}") from e
            self.fallback, self.watching = reason, False
            torch.compiler.set_stance("force_eager")
            if self.rank == 0:
                # one line: the run goes on, and the summary repeats it
                print(f"dlaunch: warning: torch.compile failed, running eagerly ({reason}); "
                      "--compile-strict makes this an error", file=sys.stderr, flush=True)
        reset()
        return fn()

    def stop(self) -> None:
        """Later failures propagate (compilation is expected to be done after warm-up)."""
        self.watching = False


def compile_stats(fallback: str | None = None) -> dict[str, Any]:
    """The `compile` record: graphs compiled, graph breaks and recompilations, with reasons, from
    Dynamo's process-wide counters (one graph-break entry per distinct reason) and compilation
    metrics (a deque of 64 entries, each recompilation with its guard-failure reason)."""

    # deferred: Dynamo is loaded only where something compiled (see runtime/__init__)
    from torch._dynamo.utils import counters, get_compilation_metrics

    breaks = counters["graph_break"]
    recompiles = [m.recompile_reason for m in get_compilation_metrics() if m.recompile_reason]
    return {"kind": "compile", "graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(breaks.values())),
            "break_reasons": [_first_line(r) for r in list(breaks)[:MAX_REASONS]],
            "recompiles": len(recompiles), "recompile_reasons": [_first_line(r) for r in recompiles[:MAX_REASONS]],
            "fallback": fallback}


def _first_line(reason: str) -> str:
    return _clipped(next((line.strip() for line in str(reason).splitlines() if line.strip()), ""))


def _clipped(text: str) -> str:
    """`text`, cut to REASON_CHARS with "..." when longer."""
    return text if len(text) <= REASON_CHARS else text[:REASON_CHARS - 3] + "..."

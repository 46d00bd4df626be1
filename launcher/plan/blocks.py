"""The repeated-block structure of a model: which blocks are interchangeable, the container
that holds them, and running a model through its first few of them.

A transformer's layers are identical, so the profile (plan.profile) and Dynamo's trace
(plan.compile_probe) go through the first blocks only and scale or reuse what they find: a 70B
model in well under a second. Never imports cli, backends, jobs, runtime or report; torch only
inside functions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn


def signature(module: Any) -> tuple[Any, ...]:
    """What makes two blocks interchangeable for profiling: module types and tensor shapes."""
    return (tuple(type(m).__qualname__ for m in module.modules()),
            tuple((n, tuple(t.shape), t.dtype) for n, t in module.named_parameters()),
            tuple((n, tuple(t.shape), t.dtype) for n, t in module.named_buffers()))


def repeated_container(model: Any, blocks: Sequence[Any]) -> nn.Module | None:
    """The ModuleList/Sequential/ModuleDict holding exactly `blocks`, in order, when every block
    has the same structure (a transformer's layers); None otherwise."""
    from torch import nn

    if len(blocks) < 4:  # too few to gain from extrapolating
        return None
    first = signature(blocks[0])
    if any(signature(b) != first for b in blocks[1:]):
        return None
    for module in model.modules():
        if isinstance(module, nn.ModuleList | nn.Sequential | nn.ModuleDict):
            children = list(module._modules.values())
            if len(children) == len(blocks) and all(c is b for c, b in zip(children, blocks)):
                return module
    return None


@contextlib.contextmanager
def first_blocks(container: Any, count: int) -> Iterator[None]:
    """Temporarily keep only the first `count` children of `container`, in place (a forward sees the shorter model)."""
    items = list(container._modules.items())
    for name, _ in items[count:]:
        del container._modules[name]
    try:
        yield
    finally:
        container._modules.clear()
        container._modules.update(items)


__all__ = ["signature", "repeated_container", "first_blocks"]

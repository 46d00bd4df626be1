"""torch at the rank's door (launcher/runtime/__init__): what a rank imports before its recorder
exists loads no torch; behind the door torch is imported at module level, and only the torch
submodules that cost an import of their own are imported inside functions."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

from tests.helpers import REPO

RUNTIME = REPO / "launcher" / "runtime"
# imported before the door (or by plain scripts, and their bootstrap): never torch at module level
TORCH_FREE = ("entry", "doctor_rank", "bootstrap", "context", "preemption", "recorder", "meter")
# behind the door, these alone are imported where they are needed (the costs: runtime/__init__)
HEAVY = ("torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.tensor",
         "torch.distributed.fsdp")


def test_what_a_rank_imports_before_its_recorder_loads_no_torch():
    code = ("import importlib, sys\n"
            "for name in sys.argv[1:]:\n"
            "    importlib.import_module(name)\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    done = subprocess.run([sys.executable, "-c", code, *(f"launcher.runtime.{m}" for m in TORCH_FREE)],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def _local_torch_imports(source: str) -> list[str]:
    """The torch modules a module imports anywhere but at its top level (`if TYPE_CHECKING:`
    blocks there count as top level)."""
    tree = ast.parse(source)
    top = set()
    for stmt in tree.body:
        top.update(id(n) for n in ast.walk(stmt) if not isinstance(stmt, ast.FunctionDef | ast.ClassDef))
    out = []
    for node in ast.walk(tree):
        if id(node) in top:
            continue
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out.append(node.module or "")
    return [m for m in out if m == "torch" or m.startswith("torch.")]


def test_behind_the_door_only_heavy_torch_submodules_load_inside_functions():
    found = {p.stem: _local_torch_imports(p.read_text(encoding="utf-8")) for p in RUNTIME.glob("*.py")}
    assert found["harness"] == [] and found["window"] == []
    late = {name: [m for m in mods if not m.startswith(HEAVY)]
            for name, mods in found.items() if name not in TORCH_FREE}
    assert all(not mods for mods in late.values()), late


def test_the_local_import_finder_sees_functions_and_methods():
    source = """
import torch
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

def f():
    import torch.distributed as dist

class C:
    def m(self):
        from torch._dynamo.utils import counters
"""
    assert _local_torch_imports(source) == ["torch.distributed", "torch._dynamo.utils"]

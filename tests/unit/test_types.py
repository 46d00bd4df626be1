"""No `Any` at module boundaries: every public function and method of launcher/ is fully annotated.

mypy (run by `scripts/dev.sh test`) checks that the annotations are right; this checks that the
public ones say something: every parameter annotated, a return type that is not a bare `Any`,
and no argparse `Namespace` (an untyped bag of attributes) outside launcher/cli.
"""

import ast
from collections.abc import Iterator

from tests.helpers import REPO

Def = ast.FunctionDef | ast.AsyncFunctionDef


def _is_bare_any(node: ast.expr | None) -> bool:
    return (isinstance(node, ast.Name) and node.id == "Any") or (
        isinstance(node, ast.Attribute) and node.attr == "Any")


def _names_namespace(node: ast.expr | None) -> bool:
    return node is not None and any(
        (isinstance(n, ast.Name) and n.id == "Namespace") or (isinstance(n, ast.Attribute) and n.attr == "Namespace")
        for n in ast.walk(node))


def _public_defs(body: list[ast.stmt], in_class: bool) -> Iterator[tuple[Def, bool]]:
    for node in body:
        if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            yield from _public_defs(node.body, in_class=True)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            yield node, in_class


def boundary_problems(source: str, where: str, *, namespace_ok: bool = False) -> list[str]:
    """Each public def of `source` that breaks the rules above, as 'where:line name: why'
    (`namespace_ok`: the module is part of the CLI)."""
    problems = []
    for fn, in_class in _public_defs(ast.parse(source).body, in_class=False):
        static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)
        params = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]
        if in_class and not static and params:
            params = params[1:]  # self / cls
        params += [a for a in (fn.args.vararg, fn.args.kwarg) if a is not None]
        label = f"{where}:{fn.lineno} {fn.name}"
        problems += [f"{label}: parameter {a.arg} has no annotation" for a in params if a.annotation is None]
        if fn.returns is None:
            problems.append(f"{label}: no return annotation")
        elif _is_bare_any(fn.returns):
            problems.append(f"{label}: returns Any")
        if not namespace_ok and any(_names_namespace(a) for a in [fn.returns, *(p.annotation for p in params)]):
            problems.append(f"{label}: argparse Namespace outside launcher/cli")
    return problems


SAMPLE = (
    "from typing import Any\n"
    "def ok(x: int, *a: str, **k: float) -> int: ...\n"
    "def _private(x): ...\n"
    "def loose(x, y: int) -> Any: ...\n"
    "class C:\n"
    "    def m(self, z) -> None: ...\n"
    "    @staticmethod\n"
    "    def s(w: int): ...\n"
    "def parsed(a: argparse.Namespace) -> int: ...\n"
)


def test_checker_flags_unannotated_any_returns_and_namespaces():
    expected = [
        "m.py:4 loose: parameter x has no annotation",
        "m.py:4 loose: returns Any",
        "m.py:6 m: parameter z has no annotation",
        "m.py:8 s: no return annotation",
    ]
    assert boundary_problems(SAMPLE, "m.py") == [*expected, "m.py:9 parsed: argparse Namespace outside launcher/cli"]
    assert boundary_problems(SAMPLE, "m.py", namespace_ok=True) == expected


def test_public_launcher_api_is_annotated_without_any_returns():
    root = REPO / "launcher"
    problems = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(REPO)
        problems += boundary_problems(path.read_text(), str(rel), namespace_ok=rel.parts[1] == "cli")
    assert not problems, "\n".join(problems)

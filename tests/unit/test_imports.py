"""The package's import structure: every module imports on its own, no module imports another
that (directly or through others) imports it back, and the CLI starts without torch."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.helpers import REPO

PACKAGE = REPO / "launcher"

# Import edges (importer, imported) of cycles that are being taken apart right now; each one
# hides its cycle from test_no_import_cycles. Remove an entry as soon as its cycle is gone.
KNOWN: set[tuple[str, str]] = set()


def module_name(path: Path) -> str:
    """`launcher/a/b.py` -> `launcher.a.b`; a package's `__init__.py` -> the package."""
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    """Every module of the package, by name (`__main__` modules run a program: left out)."""
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if p.name != "__main__.py"}


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:` (never executed, so never a cycle)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return out


def imported_modules(source: str, name: str, modules: set[str], *,
                     is_package: bool = False) -> Iterator[str]:
    """The modules among `modules` that module `name` (its `source`) imports anywhere: at
    module level or inside functions, but not under `if TYPE_CHECKING:`."""
    tree = ast.parse(source)
    skip = _type_checking_only(tree)
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            # `from launcher.x import y`: y is a submodule, or a name defined in launcher.x
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import launcher.x.y` names launcher.x.y
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target


def import_graph() -> dict[str, set[str]]:
    """importer -> the package modules it imports."""
    modules = all_modules()
    names = set(modules)
    return {name: set(imported_modules(path.read_text(encoding="utf-8"), name, names,
                                       is_package=path.name == "__init__.py"))
            for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None when the graph has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


# The layer rules (docs/layout.md): which part of the package may import which. A part is a
# subpackage (launcher/plan/) or a module at the package's root (launcher/specs.py), and
# launcher/backends/slurm/ is a part of its own (`backends.slurm`): the backends' registry
# imports it, nothing else does; imports inside a part are free. The data flows cli -> request
# -> hardware / plan -> backends -> drivers -> runtime -> results -> report; runtime runs
# inside the ranks; results read what ranks wrote; report reads results. No exceptions: a new
# edge is a design decision, made here.
FOUNDATION = {"errors", "specs", "files", "rundir", "procs", "secrets", "workload", "alloc_conf",
              "sweepmanifest", "knobs", "runspec"}
ALLOWED: dict[str, set[str]] = {
    "cli": {"request", "hardware", "plan", "backends", "drivers", "results", "report"} | FOUNDATION,
    "request": {"plan"} | FOUNDATION,
    "drivers": {"backends", "hardware", "plan", "results"} | FOUNDATION,
    "backends": {"backends.slurm", "hardware"} | FOUNDATION,
    "backends.slurm": {"backends", "hardware"} | FOUNDATION,
    "plan": {"hardware"} | FOUNDATION,
    "hardware": FOUNDATION,
    "runtime": {"hardware"} | FOUNDATION,
    "results": {"plan"} | FOUNDATION,
    "report": {"results", "plan", "hardware"} | FOUNDATION,
    # the foundation: standard library, and each other as listed
    "errors": set(), "procs": set(), "secrets": set(), "alloc_conf": set(),
    "specs": {"errors"}, "files": {"errors"}, "rundir": {"errors"}, "workload": {"errors"},
    "knobs": {"errors"}, "runspec": {"errors", "knobs", "specs"},
    "sweepmanifest": {"errors", "files", "knobs", "rundir"},
    "launcher": set(),  # the package's __init__
}


def part(module: str) -> str:
    """`launcher.plan.cost` -> `plan`; `launcher.specs` -> `specs`; `launcher` -> `launcher`;
    `launcher.backends.slurm.queue` -> `backends.slurm`."""
    parts = module.split(".")
    if parts[1:3] == ["backends", "slurm"]:
        return "backends.slurm"
    return parts[1] if len(parts) > 1 else parts[0]


def forbidden_edges(graph: dict[str, set[str]]) -> list[str]:
    """`importer -> imported` for every import between parts that ALLOWED does not list (a
    part missing from the table is an edge to add to it, not a free pass)."""
    out = []
    for importer, imported in sorted(graph.items()):
        for target in sorted(imported):
            a, b = part(importer), part(target)
            if a != b and b not in ALLOWED.get(a, set()):
                out.append(f"{importer} -> {target} ({a} -> {b})")
    return out


def test_only_allowed_edges_between_parts():
    assert forbidden_edges(import_graph()) == []
    # every part of the package has its row
    assert {part(m) for m in all_modules()} <= set(ALLOWED)
    # SLURM is reached through the Backend interface only: no command, no driver imports it
    assert "backends.slurm" not in ALLOWED["cli"] | ALLOWED["drivers"]
    assert forbidden_edges({"launcher.cli.run": {"launcher.backends.slurm.backend"}}) != []


def test_the_edge_check_names_a_forbidden_edge():
    graph = {"launcher.runtime.harness": {"launcher.report.html", "launcher.specs"},
             "launcher.report.runs": {"launcher.drivers.sweep"}, "launcher.newpart.x": {"launcher.specs"},
             "launcher.cli.run": {"launcher.backends.slurm.submit", "launcher.backends.registry"}}
    assert forbidden_edges(graph) == [
        "launcher.cli.run -> launcher.backends.slurm.submit (cli -> backends.slurm)",
        "launcher.newpart.x -> launcher.specs (newpart -> specs)",
        "launcher.report.runs -> launcher.drivers.sweep (report -> drivers)",
        "launcher.runtime.harness -> launcher.report.html (runtime -> report)"]


def test_the_graph_sees_every_kind_of_import():
    modules = {"p", "p.a", "p.b", "p.c", "p.d", "p.e", "p.f"}
    source = """
from typing import TYPE_CHECKING
import p.a
from p import b
from p.c import something

def later():
    from p.d import other
    from . import e

if TYPE_CHECKING:
    from p.f import only_for_types
"""
    assert set(imported_modules(source, "p.x", modules)) == {"p.a", "p.b", "p.c", "p.d", "p.e"}
    assert "launcher.errors" in import_graph()["launcher.specs"]
    cycle = find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert cycle == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    graph = import_graph()
    for importer, imported in KNOWN:
        graph.get(importer, set()).discard(imported)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


# Imports each module named in argv with no module of the package loaded before it: the
# package's modules are dropped from sys.modules in between (third-party ones stay, so torch
# loads once), and prints a traceback per module that fails.
IMPORT_EACH = """
import importlib, sys, traceback
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m == "launcher" or m.startswith("launcher.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except BaseException:
        print(f"import {name} failed:\\n{traceback.format_exc()}")
"""


def _import_each(names: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", IMPORT_EACH, *names], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def test_every_module_imports_alone():
    names = sorted(all_modules())
    assert len(names) > 50
    # two interpreters, half the modules each: one per core
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = list(pool.map(_import_each, [names[0::2], names[1::2]]))
    for d in done:
        assert d.returncode == 0, d.stderr
    failures = "".join(d.stdout for d in done)
    assert not failures, failures


def test_a_module_that_fails_to_import_is_reported(tmp_path):
    (tmp_path / "broken_mod.py").write_text("import launcher.specs\nraise RuntimeError('boom')\n")
    done = subprocess.run([sys.executable, "-c", IMPORT_EACH, "launcher.specs", "broken_mod"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"})
    assert done.returncode == 0, done.stderr
    assert "import broken_mod failed" in done.stdout and "RuntimeError: boom" in done.stdout
    assert "launcher.specs failed" not in done.stdout


def test_the_cli_imports_without_torch():
    code = "import sys, launcher.cli.main; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False", "importing launcher.cli.main imports torch"


# Where the code asks "local or SLURM?" outside launcher/backends/: an `if`, `elif`, `while` or
# conditional expression whose test names slurm (a name, an attribute, a string). Not scanned:
# the option table (cli/args.py, option.py, options.py: which flags belong to the --slurm group)
# and hardware/ (the SLURM allocation dlaunch itself runs inside, for `inspect`): neither picks
# where ranks run.
NOT_LAUNCH_CODE = ("launcher/cli/args.py", "launcher/cli/option.py", "launcher/cli/options.py",
                   "launcher/hardware/")
MAX_SLURM_BRANCHES = 2


def slurm_branches(root: Path = PACKAGE) -> list[str]:
    """`path:line: test` of every local-vs-SLURM branch of `root` outside the backends."""
    def names_slurm(node: ast.AST) -> bool:
        return any((isinstance(n, ast.Name) and "slurm" in n.id.lower())
                   or (isinstance(n, ast.Attribute) and "slurm" in n.attr.lower())
                   or (isinstance(n, ast.Constant) and isinstance(n.value, str) and "slurm" in n.value.lower())
                   for n in ast.walk(node))

    out = []
    for path in sorted(root.rglob("*.py")):
        rel = str(path.relative_to(root.parent))
        if rel.startswith("launcher/backends/") or rel.startswith(NOT_LAUNCH_CODE):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.If, ast.IfExp, ast.While)) and names_slurm(node.test):
                out.append(f"{rel}:{node.lineno}: {ast.unparse(node.test)}")
    return out


def test_local_vs_slurm_branches_stay_in_the_backends():
    """Every command takes a Backend and calls it polymorphically (placement, render, start,
    follow, status); the branches left outside launcher/backends/ are the doctor report's
    wording of a SLURM job's nodes:

    - results/doctor.py, `DoctorReport.exclude`: a SLURM job's bad nodes are an `--exclude`
      list; on this host the ranks are named instead;
    - results/doctor_view.py, `header_lines`: "N node(s) of a SLURM job" or "this host".
    """
    found = slurm_branches()
    assert len(found) <= MAX_SLURM_BRANCHES, "\n".join(found)
    assert [f.split(":")[0] for f in found] == ["launcher/results/doctor.py", "launcher/results/doctor_view.py"]


def test_the_branch_scan_sees_every_kind_of_test(tmp_path: Path):
    pkg = tmp_path / "launcher"
    (pkg / "backends").mkdir(parents=True)
    (pkg / "backends" / "x.py").write_text("if slurm:\n    pass\n")  # inside the backends: free
    (pkg / "a.py").write_text("if opts.slurm is not None:\n    pass\nwhile SLURM_JOB:\n    pass\n"
                              "y = 1 if 'slurm.json' in names else 2\nif here:\n    pass\n")
    found = [f.split(": ", 1)[0] for f in slurm_branches(pkg)]
    assert sorted(found) == ["launcher/a.py:1", "launcher/a.py:3", "launcher/a.py:5"]


# The package's size when issue 33 (one door, one declaration per knob) began: the step that
# consolidated it was to leave it no larger, and a module past 400 lines holds two ideas. A
# feature adds what it needs and raises this by as much: --fsdp-unit (issue 34) and the
# reduce-scatter input FSDP2 copies the gradients into (plan.memory) +119; the EFA link kind and
# its detection, `linear_units_ok` (one rule where four copies were, with its imports) and the
# CLI's log filter as a function added once per handler (it was added again on each main()) +15;
# zero1's own even sharding with one all-gather (parameters staged through the host, aligned, for
# elementwise optimizers) and checkpoints that join and cut its pieces again shard by shard, where
# torch's ZeroRedundancyOptimizer broadcast once per rank +97; attention written out as a kernel the plan prices
# (detected by its softmax of scores, its matmuls counted as attention FLOPs, its scores' bytes held by dtype) +44;
# plan.memory past 400 lines split along its ideas, what backward keeps into plan.activations (its docstring and
# imports) +18; the scores a softmax into fp32 keeps (transformers' eager attention) counted apart +10; a kernel
# given against the profile's holding its own scores, nn.MultiheadAttention seen, written-out attention recomputed
# under selective checkpointing, the scores' dtype in the memory note, the scores scaled with the square of a
# goal's sequence length +49. Linear units refused beside selective checkpointing (its recompute replays the forward's
# ops one for one; FSDP's hooks add others), the root kept gathered from forward to backward (and counted beside
# the loss gradient) +11. The post-mortem lists a rank that left with SIGTERM's code after the root cause, and a rank
# ignores SIGTERM while it writes its summary +5. `plan --world-sizes` names the sizes where nothing fits and plans
# the others; float8 forced on a GPU without float8 tensor cores refused in one line; a predicted superlinear
# sweep warns; the plan's reasons price offload's host link alone and compare like with like (+34). A plain script
# beats from its start (the start-up allowance holds a script stuck before its first step), status and the
# post-mortem do not count its steps against launch.json's, a straggler needs 1 ms too (+29). No GPU step is
# shorter than the host takes to launch its ops, and a plan it sets is as uncertain as they are (+22); cancel on
# a completed run names no empty reason (+1). The review's mends: a script's start-up beat is best-effort and
# its stall says how to leave a script unwatched, a beat count that starts again is progress, CUDA graphs and
# offload in the launch floor (+16). A rank slow in its own compute whose step reads a little faster (its work
# between steps hidden in the others' wait) is still a straggler (+3). A user's review: a script rank that exits 0
# early is named before the peer it left in a collective, a script's uncaught error reads as `python SCRIPT`
# prints it, a directory of several workloads' runs draws one workload's curve, a killed rank got as far as its
# heartbeat says, a script's warm-up is not bounded by the steps it cannot set; one heartbeat writer (+48); the
# lab says when its compiled run's slowest step suggests a compile after the warm-up (+7). The review's mends:
# the early leaver is blamed only for a script not stopped by dlaunch, with code 0 and a time; a summary older
# than the attempt's start sets no step count; unread workloads in a directory of runs are named (+8). A
# step timing whose larger size timed a part faster (noise) extrapolates it in proportion, not to zero (+4). The
# H200's offloaded 7B step: the host step priced by the optimizer's kernel (the profile's optimizer_fused), the
# node's memory bandwidth measured and cached, backward's copies out after its copies in, the fp32 copy of the
# prefetched unit in GPU memory; the checkpointing reason compares strategies field by field (+84). The loss
# outside the compiled forward stays unfused; FSDP's model left on the host for fully_shard to move a unit at a
# time; an offloaded plan's interval widened by what its copies took past their price (+23). The bandwidth
# probe streams on every usable core whatever OMP_NUM_THREADS says (+6). A rank that wrote "ok" and then failed as
# it exited is named by its exit code, and a peer torchrun or dlaunch stopped meanwhile is listed after it (+16).
# A sharded run's model is built once, on rank 0, the other ranks' modules on the meta device until every shard gets
# rank 0's values after wrapping (runtime/build.py; a build that fails on the meta device runs on every rank as
# before), and a plan warns where the host cannot hold that build (+120). The review's mends: the ranks agree on the
# build's path, the generator is set after the meta build, torch 2.6 cuts slices without `src_data_rank`; a rank
# that said ok and then exited with any code while another rank was the cause is listed after it; a tensor kept
# as a plain attribute sends the build to every rank (+22). Who builds the model is one rule on Strategy, which the
# plan and the runtime both read (+4). The optimizer's step on the GPU, on CPU ranks and on an offloading host is
# priced by the workload's own optimizer's state bytes, not always AdamW's, and a profile that names no optimizer
# takes the goal's for its memory and its step alike (+26).
MAX_PACKAGE_LINES = (24_477 + 119 + 15 + 97 + 44 + 18 + 10 + 49 + 11 + 5 + 34 + 29 + 22 + 1 + 16 + 3 + 48 + 7 + 8 + 4
                     + 84 + 23 + 6 + 16 + 120 + 22 + 4 + 26)
MAX_MODULE_LINES = 400


def line_counts(package: Path = PACKAGE) -> dict[str, int]:
    """Lines of every .py file below `package`, by path from the repo."""
    return {str(p.relative_to(package.parent)): len(p.read_bytes().splitlines())
            for p in sorted(package.rglob("*.py"))}


def test_no_module_past_400_lines_and_the_package_no_larger():
    counts = line_counts()
    too_long = {path: n for path, n in counts.items() if n > MAX_MODULE_LINES}
    assert not too_long, f"split these along their ideas: {too_long}"
    assert sum(counts.values()) <= MAX_PACKAGE_LINES, (
        f"launcher/ has {sum(counts.values())} lines, over {MAX_PACKAGE_LINES}: consolidate before adding")


def test_the_line_count_covers_every_python_file_below(tmp_path: Path):
    pkg = tmp_path / "launcher"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n\ny = 2\n")
    (pkg / "sub" / "b.py").write_text("z = 3")  # a last line without its newline still counts
    (pkg / "notes.txt").write_text("not python\n")
    assert line_counts(pkg) == {"launcher/a.py": 3, "launcher/sub/b.py": 1}

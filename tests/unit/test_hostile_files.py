"""Hostile topology files and dlaunch.yaml: each is refused with one bounded line, exit 2, at once.

A few hundred bytes of YAML can describe a billion nodes (aliases), a number Python will not
parse, or nesting that overflows the stack; a file can be gigabytes. Every case runs the real
CLI (`dlaunch plan --topology FILE`, or `run --slurm --dry-run` for dlaunch.yaml) under a
subprocess timeout far below what these files cost before they were capped. Also here: the JSON
dlaunch writes is strict (no bare NaN / Infinity).
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from launcher.files import append_lines, atomic_write_json, json_text, read_jsonl, shown

from tests.helpers import REPO, WORKLOADS, Done, assert_one_line_error, run_dlaunch, strict_json

GPT = str(WORKLOADS / "gpt.py")
MLP = str(WORKLOADS / "mlp.py")
GOOD = (REPO / "topologies" / "cpu-local.yaml").read_text()
# seconds: python start-up on a busy 2-core machine is a few; these inputs took a minute or more
BOUND_S = 30
LONGEST_LINE = 400  # an error line echoing a hostile value stays about this short


def _laughs(levels: int = 9) -> str:
    """The billion-laughs document: each level an anchored list of 9 aliases of the one below."""
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]")
    return "\n".join(lines) + "\n"


def _with(key: str, value: str) -> str:
    """The good CPU topology with the first `key: value` line's value replaced."""
    lines = GOOD.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith(f"{key}:"))
    lines[at] = f"{lines[at].split(':')[0]}: {value}"
    return "\n".join(lines) + "\n"


# id -> (file text, words the error line must hold)
TOPOLOGY_CASES: dict[str, tuple[str, tuple[str, ...]]] = {
    "billion-laughs-name": (_laughs() + _with("name", "*l8"), ("aliases expanded",)),
    "5000-digit-integer": (_with("num_nodes", "9" * 5000), ("number of 5000 characters",)),
    "50000-nested-lists": (_with("name", "[" * 50_000 + "]" * 50_000), ("nested more than",)),
    "2-mib-file": (GOOD + "# padding\n" * 220_000, ("too large",)),
    "num-nodes-1e30": (_with("num_nodes", "1e30"), ("num_nodes is out of range",)),
    "num-nodes-10-to-the-12": (_with("num_nodes", "1000000000000"), ("num_nodes is out of range",)),
    "mem-gib-1e308": (_with("mem_gib", "1.0e+308"), ("accelerator.mem_gib is out of range",)),
    "mem-gib-1e308-yaml11-string": (_with("mem_gib", "1e308"), ("mem_gib is out of range",)),
    "bw-inf": (_with("bw_gb_s", ".inf"), ("intra_node.bw_gb_s is out of range",)),
    "latency-nan": (_with("latency_us", ".nan"), ("intra_node.latency_us is out of range",)),
    "long-string-echoed": (_with("device", "x" * 100_000), ("device must be one of",)),
    "long-list-echoed": (_with("name", "[" + ", ".join(["abc"] * 5000) + "]"),
                         ("name must be a non-empty string",)),
    "long-key-echoed": (GOOD + "? " + "k" * 100_000 + "\n: 1\n", ("unknown key",)),
}


def _write_and_plan(tmp_path: Path, case: str, text: str) -> Done:
    path = tmp_path / f"{case}.yaml"
    path.write_text(text)
    return run_dlaunch("plan", GPT, "--topology", str(path), timeout=BOUND_S)


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Done]:
    root = tmp_path_factory.mktemp("hostile")
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {case: pool.submit(_write_and_plan, root, case, text)
                   for case, (text, _) in TOPOLOGY_CASES.items()}
        return {case: f.result() for case, f in futures.items()}


def test_the_good_file_plans():
    """The cases differ from a file that plans by the one hostile line only."""
    done = run_dlaunch("plan", GPT, "--topology", "cpu-local", "--gpus", "1", timeout=120)
    assert done.code == 0, done.err


@pytest.mark.parametrize("case", sorted(TOPOLOGY_CASES))
def test_hostile_topology_is_one_bounded_line(planned: dict[str, Done], case: str):
    done = planned[case]
    assert_one_line_error(done, f"{case}.yaml", *TOPOLOGY_CASES[case][1])
    assert len(done.err.strip()) < LONGEST_LINE, done.err[:LONGEST_LINE]


def test_hostile_dlaunch_yaml_goes_through_the_same_reader(tmp_path: Path):
    (tmp_path / "dlaunch.yaml").write_text(_laughs() + "slurm:\n  partition: *l8\n")
    done = run_dlaunch("run", MLP, "--slurm", "--dry-run", cwd=tmp_path, timeout=BOUND_S)
    assert_one_line_error(done, "dlaunch.yaml", "aliases expanded")
    (tmp_path / "dlaunch.yaml").write_text("slurm:\n  partition: gpu\n" + "#\n" * 600_000)
    done = run_dlaunch("run", MLP, "--slurm", "--dry-run", cwd=tmp_path, timeout=BOUND_S)
    assert_one_line_error(done, "dlaunch.yaml", "too large")


def test_aliases_that_stay_small_still_load(tmp_path: Path):
    """Capping alias expansion must not refuse ordinary YAML that uses an anchor or two."""
    from launcher.hardware.topology import load_topology

    text = GOOD.replace("intra_node:", "intra_node: &link").rstrip("\n")
    path = tmp_path / "anchors.yaml"
    path.write_text(text + "\n")
    assert load_topology(str(path)).intra_node.kind == "shm"


def test_json_written_is_strict(tmp_path: Path):
    data = {"loss": math.nan, "ranks": ({"peak": math.inf, "low": -math.inf, "ok": 1.5},)}
    assert strict_json(json_text(data)) == {"loss": None, "ranks": [{"peak": None, "low": None, "ok": 1.5}]}
    atomic_write_json(tmp_path / "r.json", data)
    assert strict_json((tmp_path / "r.json").read_text())["loss"] is None
    append_lines(tmp_path / "r.jsonl", [{"kind": "step", "loss": math.nan}])
    line = (tmp_path / "r.jsonl").read_text()
    assert strict_json(line) == {"kind": "step", "loss": None}
    assert read_jsonl(tmp_path / "r.jsonl") == ([{"kind": "step", "loss": None}], None)


def test_shown_bounds_what_an_error_echoes():
    assert shown("abc") == "'abc'"
    assert len(shown("x" * 10**6)) <= 80 and len(shown(list(range(10**6)))) <= 80
    assert len(shown(10**4000)) <= 80

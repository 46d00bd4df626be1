"""The planner against published GPU training throughput (benchmarks/published/results.yaml).

For each row: profile workloads/gpt.py at the row's shape and sequence length, plan it on the
topology file for the row's GPU and network, reshaped to its nodes and GPUs, with the published
strategy, micro-batch, accumulation, checkpointing, precision and compile forced, through the
same code as `dlaunch plan` (`launcher.plan.resolve`). Prints predicted / published tokens/s per
GPU per row, per source, the median |pred/pub - 1|, the share within 25%, and the scaling
efficiency of each series of rows that differ only in GPU count, predicted against published.

    .venv/bin/python benchmarks/published/run.py            # every row
    .venv/bin/python benchmarks/published/run.py --cli ID   # also row ID through `dlaunch plan`
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from launcher.errors import PlanError  # noqa: E402
from launcher.plan.resolve import plan_workload, resolve_topology  # noqa: E402
from launcher.specs import Goal  # noqa: E402

DATA = Path(__file__).with_name("results.yaml")
WORKLOAD = str(ROOT / "workloads" / "gpt.py")
WITHIN = 0.25
# Published strategy names -> the planner's.
STRATEGIES = {"fsdp-full": "fsdp_full", "hybrid": "hybrid", "fsdp-grad-op": "fsdp_grad_op",
              "ddp": "ddp"}
# Share of the forward recomputed in backward. "selective": torchtitan's per-layer option
# checkpoints every other block, its per-op policy saves every other matmul's output, and
# fms-fsdp's selective_checkpointing checkpoints every n-th block: about half either way.
RECOMPUTE = {"full": 1.0, "selective": 0.5}
KEYS = ("id", "model", "shape", "seq_len", "gpu", "gpus", "nodes", "interconnect", "strategy",
        "micro_batch", "grad_accum", "activation_checkpointing", "precision", "compile",
        "tokens_per_s_per_gpu", "source")
SHAPE_KEYS = ("dim", "layers", "heads", "kv_heads", "ffn", "vocab", "norm", "mlp", "pos",
              "tied_embeddings")


def load_rows(path: Path = DATA) -> list[dict[str, Any]]:
    """The rows of the data file; ValueError naming the row for a missing key or source."""
    rows = yaml.safe_load(path.read_text(encoding="utf-8"))["rows"]
    for row in rows:
        missing = [k for k in KEYS if k not in row] + [
            f"shape.{k}" for k in SHAPE_KEYS if k not in (row.get("shape") or {})]
        source = row.get("source") or {}
        if not (source.get("url", "").startswith("http") and source.get("where")):
            missing.append("source.url/where")
        if missing:
            raise ValueError(f"row {row.get('id')!r}: missing {', '.join(missing)}")
    return rows


def topology_name(row: Mapping[str, Any]) -> str:
    """The shipped topology file for the row's GPU and network (see topologies/*.yaml)."""
    gpu, net = row["gpu"], row["interconnect"].lower()
    if gpu == "a100-sxm-40g":
        return "a100-sxm-40g-8x16node-roce1600"
    if gpu == "a100-sxm-80g":
        if "1600" in net:
            return "a100-sxm-8x16node-roce1600"
        if "400 gbps" in net:
            return "a100-sxm-8x16node-400g"
        return "a100-sxm-8x8node-ib"  # not stated: a DGX A100 SuperPOD-style HDR fabric
    if gpu == "h100-sxm":
        if "grand teton" in net:
            return "h100-sxm-96g-8x16node-roce"
        if "800 gbps" in net:
            return "h100-sxm-8x12node-800g"
        return "h100-sxm-8x4node-ib"  # 3.2 Tbps, or not stated: 8x NDR rails per node
    raise ValueError(f"row {row['id']}: no topology for gpu {gpu!r}")


def workload_args(row: Mapping[str, Any]) -> list[str]:
    """workloads/gpt.py options that build the row's shape at its sequence length."""
    s = row["shape"]
    base = "mpt-7b" if s["norm"] == "layernorm" else "llama2-7b"  # the style's defaults
    args = ["--size", base, "--seq-len", str(row["seq_len"])]
    for key in ("dim", "layers", "heads", "kv_heads", "ffn", "vocab"):
        args += [f"--{key.replace('_', '-')}", str(s[key])]
    args += ["--norm", s["norm"], "--mlp", s["mlp"],
             "--pos", "learned" if s["pos"] in ("learned", "alibi") else s["pos"]]
    return args + (["--tie-embeddings"] if s["tied_embeddings"] else [])


def overrides(row: Mapping[str, Any]) -> dict[str, Any]:
    """The published settings, as planner overrides."""
    ac = row["activation_checkpointing"]
    strategy = STRATEGIES[row["strategy"]]
    if strategy == "hybrid" and row["nodes"] <= 1:
        strategy = "fsdp_full"  # one node: hybrid shard is full shard
    ov: dict[str, Any] = {"strategy": strategy, "precision": row["precision"],
                          "micro_batch": row["micro_batch"], "compile": bool(row["compile"]),
                          "activation_checkpointing": ac in RECOMPUTE}
    if ac in RECOMPUTE:
        ov["recompute_fraction"] = RECOMPUTE[ac]
    if row.get("tp", 1) > 1:
        ov["tp"] = row["tp"]  # 2-D rows: tensor parallel inside a node (optional key, 1 = none)
    return ov


@dataclass(frozen=True, kw_only=True)
class Result:
    """One row, predicted."""

    row: Mapping[str, Any]
    predicted: float
    mem_share: float  # predicted peak memory / usable memory
    comm_exposed_share: float

    @property
    def ratio(self) -> float:
        """Predicted over published tokens/s per GPU."""
        return self.predicted / self.row["tokens_per_s_per_gpu"]


def predict(row: Mapping[str, Any], *, nodes: int | None = None) -> Result:
    """Plan the row as published (on `nodes` nodes instead, if given) and return the predicted
    tokens/s per GPU."""
    nodes = nodes or row["nodes"]
    topo = resolve_topology(topology=topology_name(row), gpus=row["gpus"] // row["nodes"],
                            nodes=nodes)
    # with TP, tp GPUs share each sample: the global batch counts data-parallel ranks
    goal = Goal(global_batch=row["micro_batch"] * row["grad_accum"] * topo.world_size
                // row.get("tp", 1), seq_len=row["seq_len"])
    planned = plan_workload(WORKLOAD, workload_args(row), topo, goal, overrides=overrides(row))
    p, t = planned.plan, planned.plan.chosen.time
    return Result(row=row, predicted=p.units_per_s / p.world_size,
                  mem_share=p.chosen.memory.total_bytes / p.usable_mem_bytes,
                  comm_exposed_share=t.comm_exposed_s / t.step_time_s)


def series(results: Sequence[Result]) -> list[tuple[str, Result, Result, bool]]:
    """(name, smallest, largest, clean) per group of rows with the same model, sequence length,
    GPU, interconnect, strategy, checkpointing, compile and source and at least two GPU counts.
    Clean groups also share micro-batch and accumulation: weak scaling of the same per-GPU work,
    what scaling efficiency means. The others (the batch changes with the GPU count) follow."""
    def key(r: Result, clean: bool) -> tuple[Any, ...]:
        w = r.row
        base = (w["model"], w["seq_len"], w["gpu"], w["interconnect"], w["strategy"],
                w["activation_checkpointing"], w["compile"], w["source"]["url"])
        return base + ((w["micro_batch"], w["grad_accum"]) if clean else ())

    out = []
    for clean in (True, False):
        groups: dict[tuple[Any, ...], list[Result]] = {}
        for r in results:
            groups.setdefault(key(r, clean), []).append(r)
        for members in groups.values():
            lo = min(members, key=lambda r: r.row["gpus"])
            hi = max(members, key=lambda r: r.row["gpus"])
            batches = {(r.row["micro_batch"], r.row["grad_accum"]) for r in members}
            if lo.row["gpus"] == hi.row["gpus"] or (not clean and len(batches) == 1):
                continue
            w = lo.row
            name = (f"{w['model']} {w['gpu']} s{w['seq_len']} ac={w['activation_checkpointing']}"
                    f"{' compile' if w['compile'] else ''}"
                    + (f" mb {w['micro_batch']}x{w['grad_accum']}" if clean else ""))
            out.append((name, lo, hi, clean))
    return out


def _source(row: Mapping[str, Any]) -> str:
    return row["id"].split("-")[0]


def report(results: Sequence[Result]) -> tuple[list[str], dict[str, Any]]:
    """The printed lines and the summary numbers."""
    lines = ["memory: predicted peak / usable (over 100%: the planner says it does not fit)",
             f"{'row':<46}{'GPUs':>5} {'mb x acc':>8} {'ac':>5} {'pred':>8} {'published':>9}"
             f" {'ratio':>6} {'exposed':>8} {'memory':>7}"]
    for r in results:
        w = r.row
        lines.append(f"{w['id'][:46]:<46}{w['gpus']:>5} {w['micro_batch']:>3} x {w['grad_accum']:<3}"
                     f"{w['activation_checkpointing'][:5]:>6} {r.predicted:>8,.0f} "
                     f"{w['tokens_per_s_per_gpu']:>9,} {r.ratio:>6.2f}  "
                     f"{r.comm_exposed_share:>8.0%} {r.mem_share:>7.0%}")
    errors = [abs(r.ratio - 1) for r in results]
    summary: dict[str, Any] = {
        "rows": len(results), "median_abs_error": statistics.median(errors),
        "share_within_25pct": sum(e <= WITHIN for e in errors) / len(errors), "sources": {},
        "series": []}
    lines.append("")
    lines.append(f"{'source':<12}{'rows':>5}{'median |pred/pub-1|':>21}{'within 25%':>12}"
                 f"{'median ratio':>14}")
    for src in dict.fromkeys(_source(r.row) for r in results):
        mine = [r for r in results if _source(r.row) == src]
        errs = [abs(r.ratio - 1) for r in mine]
        s = {"rows": len(mine), "median_abs_error": statistics.median(errs),
             "share_within_25pct": sum(e <= WITHIN for e in errs) / len(errs),
             "median_ratio": statistics.median(r.ratio for r in mine)}
        summary["sources"][src] = s
        lines.append(f"{src:<12}{s['rows']:>5}{s['median_abs_error']:>21.3f}"
                     f"{s['share_within_25pct']:>12.0%}{s['median_ratio']:>14.2f}")
    lines.append(f"{'all':<12}{len(results):>5}{summary['median_abs_error']:>21.3f}"
                 f"{summary['share_within_25pct']:>12.0%}"
                 f"{statistics.median(r.ratio for r in results):>14.2f}")
    lines.append("")
    lines.append("scaling efficiency, smallest -> largest GPU count (per-GPU tokens/s ratio); "
                 "clean = same micro-batch and accumulation")
    for name, lo, hi, clean in series(results):
        pub = hi.row["tokens_per_s_per_gpu"] / lo.row["tokens_per_s_per_gpu"]
        pred = hi.predicted / lo.predicted
        gap = 100 * (pred - pub)
        summary["series"].append({"series": name, "gpus": [lo.row["gpus"], hi.row["gpus"]],
                                  "published": pub, "predicted": pred, "clean": clean})
        lines.append(f"  {name:<52} {lo.row['gpus']:>3} -> {hi.row['gpus']:<4} published "
                     f"{pub:>6.1%} predicted {pred:>6.1%} ({gap:+.1f} points)"
                     + ("" if clean else "  [batch differs]"))
    lines.append("beyond the data (the first row of the largest clean series, same settings on "
                 "more nodes):")
    clean = [x for x in series(results) if x[3]]
    if clean:
        base = max(clean, key=lambda x: x[2].row["gpus"] / x[1].row["gpus"])[1]
        for nodes in (16, 64):
            r = predict(base.row, nodes=nodes)
            lines.append(f"  {base.row['id']} on {nodes * base.row['gpus'] // base.row['nodes']}"
                         f" GPUs: {r.predicted:,.0f} tokens/s/GPU, {r.predicted / base.predicted:.1%}"
                         f" of {base.row['gpus']} GPUs")
    clean_gaps = [abs(s["predicted"] - s["published"]) for s in summary["series"] if s["clean"]]
    summary["clean_series_max_gap_points"] = 100 * max(clean_gaps) if clean_gaps else None
    lines.append("")
    gap = summary["clean_series_max_gap_points"]
    lines.append(f"median |pred/pub - 1| = {summary['median_abs_error']:.3f}; within 25%: "
                 f"{summary['share_within_25pct']:.0%} of {len(results)} rows; clean scaling "
                 "series max gap " + ("(no series)" if gap is None else f"{gap:.1f} points"))
    return lines, summary


def cli_check(row: Mapping[str, Any]) -> str:
    """Plan `row` through the real `dlaunch plan --json` and in-process with the same forced
    settings (the command has no flag for some, e.g. selective checkpointing): equal numbers
    mean the benchmark runs the command's code path."""
    help_text = subprocess.run([sys.executable, "-m", "launcher.cli", "plan", "--help"],
                               capture_output=True, text=True, cwd=ROOT, check=True).stdout
    ov = overrides(row)
    flags = {"strategy": "--strategy", "precision": "--precision", "micro_batch": "--micro-batch"}
    forced = {k: ov[k] for k in flags}
    cmd = [sys.executable, "-m", "launcher.cli", "plan", WORKLOAD, "--json",
           "--topology", topology_name(row), "--nodes", str(row["nodes"]),
           "--gpus", str(row["gpus"] // row["nodes"]), "--seq-len", str(row["seq_len"]),
           "--global-batch", str(row["micro_batch"] * row["grad_accum"] * row["gpus"])]
    for key, flag in flags.items():
        cmd += [flag, str(ov[key])]
    for key, flag in (("compile", "--compile"),
                      ("activation_checkpointing", "--activation-checkpointing")):
        if ov[key] and flag in help_text and "recompute_fraction" not in ov:
            cmd.append(flag)
            forced[key] = ov[key]
    out = subprocess.run(cmd + ["--", *workload_args(row)], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    via_cli = json.loads(out)["plan"]
    topo = resolve_topology(topology=topology_name(row), gpus=row["gpus"] // row["nodes"],
                            nodes=row["nodes"])
    goal = Goal(global_batch=row["micro_batch"] * row["grad_accum"] * row["gpus"],
                seq_len=row["seq_len"])
    mine = plan_workload(WORKLOAD, workload_args(row), topo, goal, overrides=forced).plan
    a, b = via_cli["units_per_s"] / via_cli["world_size"], mine.units_per_s / mine.world_size
    return (f"--cli {row['id']}: `dlaunch plan` {a:,.0f} tokens/s/GPU, in-process {b:,.0f} "
            f"with the same forced settings ({', '.join(sorted(forced))}): "
            + ("identical" if abs(a / b - 1) < 1e-9 else f"DIFFERENT ({a / b - 1:+.2%})"))


def main(argv: Sequence[str] | None = None) -> int:
    """Run every row (or `--only` some) and print the comparison."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", default=None, help="row ids (prefixes) to run")
    ap.add_argument("--cli", default=None, help="also plan this row id through `dlaunch plan`")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON at the end")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = [r for r in load_rows()
            if not args.only or any(r["id"].startswith(p) for p in args.only)]
    results = []
    for r in rows:
        try:
            results.append(predict(r))
        except PlanError as e:
            if r.get("tp", 1) == 1:
                raise
            # a 2-D row needs the workload's tp_plan: say why it was not planned
            print(f"{r['id']}: not planned: {e}")
    lines, summary = report(results)
    print("\n".join(lines))
    if args.cli:
        print(cli_check(next(r for r in rows if r["id"] == args.cli)))
    print(f"({len(rows)} rows in {time.perf_counter() - t0:.1f} s)")
    if args.json:
        print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

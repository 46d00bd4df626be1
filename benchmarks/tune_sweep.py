"""`dlaunch tune` against an exhaustive sweep: does a 4-trial tune find the best configuration?

    .venv/bin/python benchmarks/tune_sweep.py [--workloads gpt mlp] [--gpus 2] [--repeats 3]
        [--steps N] [--trials 4] [--json FILE]

For each workload, on this machine (CPU ranks, gloo):
1. the sweep: every strategy (DDP, FSDP full, FSDP grad-op) x precision (fp32, bf16) x
   micro-batch (4, 8, 16) x activation checkpointing (off, on) that the planner says fits, each
   a real `dlaunch run` (calibration off, the same seed and data), `--repeats` times in
   alternating passes; a configuration's throughput is the median of its runs' samples/s;
2. `dlaunch tune --trials K` from an empty correction cache: its choice is looked up in the sweep
   (the same measurement for every configuration) and compared with the sweep's best
   (target: >= 0.97 of it);
3. after the tune (its corrections stored), a plain `dlaunch plan` against a fresh plain
   `dlaunch run` (which follows the same plan): predicted step time within 10% of the
   measured median.
Everything runs with one cache directory of its own (probes included), so earlier tunes on
this machine do not leak in. The load average is printed with every run. About 30 minutes for
gpt tiny and mlp on an idle 2-core host.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from launcher.specs import checkpointing_mode  # noqa: E402

DLAUNCH = [sys.executable, "-m", "launcher.cli.main"]
STRATEGIES = ("ddp", "fsdp_full", "fsdp_grad_op")
PRECISIONS = ("fp32", "bf16")
MICRO_BATCHES = (4, 8, 16)
SWEEP_STEPS = {"gpt": 12, "mlp": 200}  # ~0.4 s and ~11 ms steps on 2 CPU ranks
TARGET_CHOICE = 0.97
TARGET_PLAN = 0.10


def load() -> str:
    """The host's load averages."""
    return Path("/proc/loadavg").read_text(encoding="utf-8").split(" 1/")[0].split()[0]


def dlaunch(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """One dlaunch command; its output captured."""
    return subprocess.run([*DLAUNCH, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          check=False)


def config_flags(c: dict[str, Any]) -> list[str]:
    """The run flags of configuration `c`."""
    return ["--strategy", c["strategy"], "--precision", c["precision"], "--micro-batch",
            str(c["micro_batch"]), "--checkpointing", c["checkpointing"]]


def key(c: dict[str, Any]) -> tuple[Any, ...]:
    """A configuration's identity."""
    return c["strategy"], c["precision"], int(c["micro_batch"]), checkpointing_mode(c["checkpointing"])


def fits(workload: Path, gpus: int, c: dict[str, Any], env: dict[str, str]) -> bool:
    """Whether the planner says configuration `c` fits."""
    done = dlaunch("plan", str(workload), "--gpus", str(gpus), *config_flags(c), "--json", env=env)
    if done.returncode != 0:
        return False
    return bool(json.loads(done.stdout)["plan"]["chosen"]["fits"])


def measure(workload: Path, gpus: int, flags: list[str], steps: int, run_dir: Path,
            env: dict[str, str]) -> dict[str, Any]:
    """One `dlaunch run`: samples/s and the median step time, or the error."""
    done = dlaunch("run", str(workload), "--gpus", str(gpus), *flags, "--steps", str(steps),
                   "--no-calibrate", "--run-dir", str(run_dir), env=env)
    result_path = run_dir / "result.json"
    if done.returncode != 0 or not result_path.exists():
        lines = [ln for ln in (done.stderr + done.stdout).splitlines() if ln.strip()]
        return {"error": lines[-1] if lines else f"exit {done.returncode}"}
    result = json.loads(result_path.read_text(encoding="utf-8"))
    return {"samples_per_s": result["samples_per_s"], "step_s": result["step_time_median_s"],
            "predicted_step_s": (result.get("prediction") or {}).get("step_time_s")}


def sweep(workload: Path, args: argparse.Namespace, root: Path,
          env: dict[str, str]) -> dict[tuple[Any, ...], dict[str, Any]]:
    """Every fitting configuration, `args.repeats` runs each; the median samples/s."""
    configs = [{"strategy": s, "precision": p, "micro_batch": mb, "checkpointing": ck}
               for s, p, mb, ck in itertools.product(STRATEGIES, PRECISIONS, MICRO_BATCHES, ("none", "full"))]
    configs = [c for c in configs if fits(workload, args.gpus, c, env)]
    steps = args.steps or SWEEP_STEPS.get(workload.stem, 12)
    runs: dict[tuple[Any, ...], list[float]] = {key(c): [] for c in configs}
    for rep in range(args.repeats):
        for i, c in enumerate(configs if rep % 2 == 0 else configs[::-1]):
            m = measure(workload, args.gpus, config_flags(c), steps,
                        root / f"sweep-{rep}-{'-'.join(map(str, key(c)))}", env)
            if "samples_per_s" in m:
                runs[key(c)].append(m["samples_per_s"])
            print(f"  [{rep + 1}/{args.repeats} {i + 1}/{len(configs)}] {key(c)} "
                  f"{m.get('samples_per_s', m.get('error'))}  load {load()}", flush=True)
    return {k: {"median": statistics.median(v), "runs": v} for k, v in runs.items() if v}


def tune_and_check(workload: Path, args: argparse.Namespace, root: Path, env: dict[str, str],
                   swept: dict[tuple[Any, ...], dict[str, Any]]) -> dict[str, Any]:
    """The tune, its choice against the sweep's best, then plan vs a fresh run of the choice."""
    steps = args.steps or SWEEP_STEPS.get(workload.stem, 12)
    tune_dir = root / "tune"
    done = dlaunch("tune", str(workload), "--gpus", str(args.gpus), "--trials", str(args.trials),
                   "--tune-dir", str(tune_dir), "--json", env=env)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["tune failed"])[-1]}
    tuned = json.loads((tune_dir / "tuned-plan.json").read_text(encoding="utf-8"))
    d = tuned["decisions"]
    chosen = key(d)
    best_key = max(swept, key=lambda k: swept[k]["median"])
    out: dict[str, Any] = {"trials": json.loads(done.stdout)["trials"], "chosen": chosen,
                           "best": best_key, "best_samples_per_s": swept[best_key]["median"]}
    if chosen in swept:
        out["chosen_samples_per_s"] = swept[chosen]["median"]
        out["choice_ratio"] = swept[chosen]["median"] / swept[best_key]["median"]
    else:  # a configuration outside the sweep's space: measure it the same way
        runs = [measure(workload, args.gpus, ["--plan", str(tune_dir / "tuned-plan.json")], steps,
                        root / f"chosen-{i}", env) for i in range(args.repeats)]
        sps = statistics.median(r["samples_per_s"] for r in runs if "samples_per_s" in r)
        out["chosen_samples_per_s"] = sps
        out["choice_ratio"] = sps / swept[best_key]["median"]
    # what a user does next: a plain `dlaunch plan` (corrections from the tune applied), then a
    # plain `dlaunch run` that follows its own plan
    plan = json.loads(dlaunch("plan", str(workload), "--gpus", str(args.gpus), "--json", env=env).stdout)
    chosen_after = plan["plan"]["chosen"]
    t = chosen_after["time"]
    predicted_step = t["compute_s"] + t["comm_exposed_s"] + t["contention_s"] + t["sync_wait_s"]
    s_after = chosen_after["strategy"]
    fresh = [measure(workload, args.gpus, [], steps, root / f"after-{i}", env) for i in range(args.repeats)]
    measured = statistics.median(r["step_s"] for r in fresh if "step_s" in r)
    out.update(plan_after_tune=(s_after["kind"], s_after["precision"], chosen_after["micro_batch"],
                                s_after["checkpointing"]),
               plan_after_tune_s=predicted_step, measured_after_tune_s=measured,
               plan_error=predicted_step / measured - 1)
    return out


def main(argv: list[str] | None = None) -> int:
    """Sweep, tune and check each workload; print the verdicts."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", nargs="+", default=["gpt", "mlp"])
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, help="steps per sweep run (default: enough to time about 2 s, "
                    "as `dlaunch tune` does: gpt 12, mlp 200)")
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    print(f"load average before: {Path('/proc/loadavg').read_text().strip()}", flush=True)
    report: dict[str, Any] = {}
    ok = True
    with tempfile.TemporaryDirectory(prefix="tune-sweep-") as tmp:
        env = {**os.environ, "DLAUNCH_CACHE_DIR": str(Path(tmp) / "cache"), "PYTHONPATH": str(REPO)}
        for name in args.workloads:
            workload = REPO / "workloads" / f"{name}.py"
            root = Path(tmp) / name
            root.mkdir()
            print(f"{name}: sweep", flush=True)
            swept = sweep(workload, args, root, env)
            print(f"{name}: tune", flush=True)
            result = tune_and_check(workload, args, root, env, swept)
            report[name] = {"sweep": {" ".join(map(str, k)): v for k, v in swept.items()},
                            **{k: v for k, v in result.items() if k != "trials"},
                            "tune_trials": result.get("trials")}
            for k, v in sorted(swept.items(), key=lambda kv: -kv[1]["median"]):
                print(f"  {' '.join(map(str, k)):<32} {v['median']:10.1f} samples/s  runs "
                      + " ".join(f"{x:.1f}" for x in v["runs"]))
            if "error" in result:
                print(f"{name}: tune failed: {result['error']}")
                ok = False
                continue
            choice_ok = result["choice_ratio"] >= TARGET_CHOICE
            plan_ok = abs(result["plan_error"]) <= TARGET_PLAN
            ok = ok and choice_ok and plan_ok
            print(f"{name}: best {result['best']} {result['best_samples_per_s']:.1f} samples/s; tune chose "
                  f"{result['chosen']} {result['chosen_samples_per_s']:.1f} ({result['choice_ratio']:.3f} "
                  f"of the best; target >= {TARGET_CHOICE}) {'ok' if choice_ok else 'MISSED'}")
            print(f"{name}: plan after tune {result['plan_after_tune']} {result['plan_after_tune_s']:.4g} s/step, "
                  f"a fresh run "
                  f"measured {result['measured_after_tune_s']:.4g} s ({result['plan_error']:+.1%}; target "
                  f"within {TARGET_PLAN:.0%}) {'ok' if plan_ok else 'MISSED'}", flush=True)
    print(f"load average after: {Path('/proc/loadavg').read_text().strip()}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

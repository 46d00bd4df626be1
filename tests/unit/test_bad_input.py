"""Bad input everywhere: every case is one clear line on stderr, exit code 2, no traceback, and
nothing written to the working directory (the run dir, when one was named, stays as it was).

Cases cover `run`, `plan`, `scale`, `report`, `lab`, `inspect`, `status`/`logs`/`cancel`,
topology files, workload files and `dlaunch.yaml`. Every case runs the real CLI in a subprocess
with its own empty working directory; the cases run four at a time in one session fixture (most
of the cost is Python start-up), then each case is checked on its own. Under pytest-xdist one
worker runs the cases and writes their outcomes to a JSON file in the run's shared temp dir,
under a file lock; the other workers wait on the lock and read the file, so the ~80 subprocesses
run once per test run, not once per worker.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from filelock import FileLock

from tests.helpers import DATA, REPO, WORKLOADS, run_dlaunch, seeded_cache

MLP = str(WORKLOADS / "mlp.py")
GPT = str(WORKLOADS / "gpt.py")
A100 = (REPO / "topologies" / "a100-sxm-8x.yaml").read_text()
# explicit strategy/precision/micro-batch: `run` has nothing to plan and fails before torch
FIXED = ["--strategy", "ddp", "--precision", "fp32", "--micro-batch", "8"]


@dataclass(frozen=True)
class Case:
    """One bad invocation: argv, the words its error line must contain, files to set up."""

    id: str
    argv: list[str]
    needles: tuple[str, ...]
    files: dict[str, str] = field(default_factory=dict)  # relative path -> text, made first
    dirs: tuple[str, ...] = ()


def _c(id: str, argv: list[str], *needles: str, files: dict[str, str] | None = None,
       dirs: tuple[str, ...] = ()) -> Case:
    return Case(id, argv, needles, files or {}, dirs)


TOPO_OK_HEAD = A100
CASES = [
    # --- run: the command line
    _c("run-missing-file", ["run", "missing.py", "--gpus", "2"], "does not exist"),
    _c("run-directory", ["run", "adir"], "is not a .py file", dirs=("adir",)),
    _c("run-not-python", ["run", "notes.txt"], "is not a .py file", files={"notes.txt": "hi\n"}),
    _c("run-no-workload", ["run"], "required"),
    _c("run-gpus-0", ["run", MLP, "--gpus", "0"], "--gpus must be an integer >= 1, got 0"),
    _c("run-gpus-negative", ["run", MLP, "--gpus", "-1"], "--gpus"),
    _c("run-gpus-abc", ["run", MLP, "--gpus", "abc"], "--gpus must be an integer >= 1, got 'abc'"),
    _c("run-steps-0", ["run", MLP, "--steps", "0"], "--steps must be an integer >= 1, got 0"),
    _c("run-warmup-too-long", ["run", MLP, "--steps", "5", "--warmup-steps", "5"],
       "--warmup-steps must be below"),
    _c("run-micro-batch-0", ["run", MLP, "--micro-batch", "0"], "--micro-batch must be an integer"),
    _c("run-log-every-0", ["run", MLP, "--log-every", "0"], "--log-every must be an integer"),
    _c("run-num-workers-negative", ["run", MLP, "--num-workers", "-1"], "--num-workers"),
    _c("run-strategy", ["run", MLP, "--strategy", "zero9"], "invalid choice", "zero9"),
    _c("run-max-grad-norm-nan", ["run", MLP, "--max-grad-norm", "nan"],
       "--max-grad-norm must be a finite number >= 0, got nan"),
    _c("run-log-to-unknown", ["run", MLP, "--log-to", "tensorboard,neptune"],
       "--log-to takes a comma-separated list of tensorboard, mlflow, wandb, got 'tensorboard,neptune'"),
    _c("run-log-to-detach", ["run", MLP, "--log-to", "mlflow", "--slurm", "--detach"],
       "--log-to mlflow with --detach"),
    _c("run-max-grad-norm-negative", ["run", MLP, "--max-grad-norm", "-1"],
       "--max-grad-norm must be a finite number >= 0, got -1"),
    _c("plan-unknown-size", ["plan", GPT, "--gpus", "1", "--", "--size", "nope"],
       "workload gpt.py: ValueError: unknown --size 'nope'; choose from tiny"),
    _c("plan-tokens-zero", ["plan", GPT, "--tokens", "0"], "--tokens must be a finite number > 0, got 0"),
    _c("plan-two-goals", ["plan", GPT, "--tokens", "1e9", "--samples", "5"], "give one training goal"),
    _c("run-precision", ["run", MLP, "--precision", "fp8"], "invalid choice", "fp8"),
    _c("run-linear-units-ddp", ["run", MLP, "--strategy", "ddp", "--fsdp-unit", "linear"],
       "--fsdp-unit linear shards each linear layer of an FSDP strategy's blocks", "or --fsdp-unit block"),
    _c("run-unknown-flag", ["run", MLP, "--bogus"], "unrecognized arguments", "--bogus"),
    # torchrun's flags get dlaunch's; workload arguments without `--` get the `--`
    _c("run-torchrun-nproc", ["run", MLP, "--nproc-per-node", "2"], "--nproc-per-node is torchrun's",
       "use --gpus N"),
    _c("run-torchrun-master-port", ["run", MLP, "--master_port=29500"], "--master_port is torchrun's",
       "not needed"),
    _c("run-workload-args-without-dashes", ["run", MLP, "--size", "tiny"],
       "arguments for the workload go after `--`", "-- --size tiny"),
    _c("run-max-grad-norm-abc", ["run", MLP, "--max-grad-norm", "abc"], "--max-grad-norm"),
    _c("run-hang-timeout-short", ["run", MLP, *FIXED, "--hang-timeout-s", "3"],
       "--hang-timeout-s must be 0 (off) or between 10"),
    _c("run-hang-timeout-abc", ["run", MLP, "--hang-timeout-s", "abc"], "--hang-timeout-s", "abc"),
    _c("run-hang-timeout-nan", ["run", MLP, *FIXED, "--hang-timeout-s", "nan"], "--hang-timeout-s"),
    _c("run-hang-timeout-inf", ["run", MLP, *FIXED, "--hang-timeout-s", "inf"], "--hang-timeout-s"),
    _c("run-startup-below-hang", ["run", MLP, *FIXED, "--startup-timeout-s", "20"],
       "--startup-timeout-s must be between --hang-timeout-s (300)"),
    _c("run-max-restarts-negative", ["run", MLP, "--max-restarts", "-1"],
       "--max-restarts must be an integer >= 0"),
    _c("run-dir-under-a-file", ["run", MLP, *FIXED, "--run-dir", "a-file/run"],
       "give a writable --run-dir", files={"a-file": ""}),
    _c("run-dir-holds-a-run", ["run", MLP, *FIXED, "--run-dir", "old"], "already holds a run",
       files={"old/result.json": "{}\n"}),
    _c("run-slurm-flag-without-slurm", ["run", MLP, "--partition", "gpu"], "needs --slurm"),
    # --- workload files
    _c("workload-syntax-error", ["run", str(DATA / "syntax_error.py")], "syntax error at line"),
    _c("workload-neither", ["run", str(DATA / "not_a_workload.py")], "neither a workload"),
    _c("workload-partial-contract", ["run", "half.py"], "defines build_model but not",
       files={"half.py": "def build_model(cfg):\n    return None\n"}),
    _c("workload-raises-on-import", ["plan", "boom.py", "--gpus", "1"], "raised on import",
       "RuntimeError: boom", files={"boom.py": "raise RuntimeError('boom')\n"
                                   "def build_model(cfg): pass\ndef make_dataset(cfg, n): pass\n"
                                   "def loss_fn(m, b): pass\n"}),
    _c("workload-unknown-option", ["run", MLP, "--", "--nosuch", "1"], "unknown option --nosuch"),
    _c("workload-option-type", ["plan", MLP, "--gpus", "1", "--", "--features", "wide"],
       "--features expects a int", "'wide'"),
    _c("workload-not-meta-safe", ["plan", str(DATA / "meta_unsafe.py"), "--gpus", "1"], "meta"),
    # --- plan
    _c("plan-missing-file", ["plan", "missing.py"], "does not exist"),
    _c("plan-gpus-0", ["plan", GPT, "--gpus", "0"], "--gpus must be an integer >= 1"),
    _c("plan-global-batch-x", ["plan", GPT, "--global-batch", "x"], "--global-batch must be an integer"),
    _c("plan-seq-len-0", ["plan", GPT, "--seq-len", "0"], "--seq-len must be an integer >= 1"),
    _c("plan-precision", ["plan", GPT, "--precision", "fp8"], "invalid choice"),
    _c("plan-plain-script", ["plan", str(DATA / "plain_train.py"), "--gpus", "1"], "plain script"),
    _c("plan-too-many-gpus", ["plan", GPT, "--topology", "h100-sxm-8x", "--gpus", "16"],
       "--gpus 16 is more than"),
    # --- topology files
    _c("topology-unknown-name", ["plan", GPT, "--topology", "no-such-machine"], "no-such-machine"),
    _c("topology-bad-yaml", ["plan", GPT, "--topology", "bad.yaml"], "bad.yaml",
       files={"bad.yaml": "name: x\ndevice: cuda\n  num_nodes: [1\n"}),
    _c("topology-negative-bandwidth", ["plan", GPT, "--topology", "neg.yaml"], "bw_gb_s",
       files={"neg.yaml": A100.replace("bw_gb_s: 230", "bw_gb_s: -230", 1)}),
    _c("topology-not-a-mapping", ["plan", GPT, "--topology", "list.yaml"], "list.yaml",
       files={"list.yaml": "- 1\n- 2\n"}),
    _c("topology-unknown-key", ["plan", GPT, "--topology", "extra.yaml"], "extra.yaml",
       files={"extra.yaml": A100 + "\nflux_capacitor: 1.21\n"}),
    _c("topology-empty", ["plan", GPT, "--topology", "empty.yaml"], "empty.yaml",
       files={"empty.yaml": ""}),
    # --- inspect, status, logs
    _c("inspect-extra-args", ["inspect", "--", "x"], "takes no arguments after"),
    _c("inspect-unknown-flag", ["inspect", "--bogus"], "unrecognized arguments"),
    _c("status-not-a-run", ["status", "nowhere"], "nowhere"),
    _c("logs-rank-negative", ["logs", "nowhere", "--rank", "-1"], "--rank must be an integer >= 0"),
    _c("cancel-not-a-run", ["cancel", "nowhere"], "nowhere"),
    # --- lab (three runs of one workload)
    _c("lab-missing-file", ["lab", "missing.py"], "does not exist"),
    _c("lab-gpus-0", ["lab", MLP, "--gpus", "0"], "--gpus must be an integer >= 1, got 0"),
    _c("lab-hang-timeout-short", ["lab", MLP, "--micro-batch", "8", "--hang-timeout-s", "5"],
       "--hang-timeout-s must be 0 (off) or between 10"),
    # --- dlaunch.yaml (read by runs on SLURM; --dry-run needs no cluster)
    _c("config-bad-yaml", ["run", MLP, "--slurm", "--dry-run"], "dlaunch.yaml", "not valid YAML",
       files={"dlaunch.yaml": "slurm: [partition\n"}),
    _c("config-unknown-key", ["run", MLP, "--slurm", "--dry-run"], "dlaunch.yaml", "unknown key",
       files={"dlaunch.yaml": "slurn:\n  partition: gpu\n"}),
    _c("config-negative-time", ["run", MLP, "--slurm", "--dry-run"], "slurm.time_min",
       files={"dlaunch.yaml": "slurm:\n  time_min: -5\n"}),
    _c("config-not-a-mapping", ["run", MLP, "--slurm", "--dry-run"], "dlaunch.yaml",
       files={"dlaunch.yaml": "- slurm\n"}),
    _c("config-empty-partition", ["run", MLP, "--slurm", "--dry-run"], "slurm.partition",
       files={"dlaunch.yaml": "slurm:\n  partition: ''\n"}),
    # --- scale
    _c("scale-gpus-abc", ["scale", MLP, "--gpus", "1,abc"], "'abc' is not an integer"),
    _c("scale-gpus-0", ["scale", MLP, "--gpus", "0,1"], "world sizes must be >= 1"),
    _c("scale-gpus-twice", ["scale", MLP, "--gpus", "1,1"], "listed twice"),
    _c("scale-gpus-too-many", ["scale", MLP, "--gpus", "1,4096"], "more than"),
    _c("scale-no-gpus", ["scale", MLP], "required"),
    _c("scale-plain-script", ["scale", str(DATA / "plain_train.py"), "--gpus", "1,2", "--mode", "strong",
                              "--global-batch", "16"], "plain script"),
    _c("scale-warmup-too-long", ["scale", MLP, "--gpus", "1", "--steps", "3", "--warmup-steps", "3"],
       "--warmup-steps must be below"),
    # --- numbers past their declared bound (issue 37): refused at parse time, naming the bound;
    # negative numbers, scientific notation too, reach the option's check as values
    _c("run-steps-huge", ["run", MLP, "--steps", "99999999999999999999"],
       "--steps must be at most 1,000,000,000", "got 99999999999999999999"),
    _c("run-micro-batch-1e7", ["run", MLP, "--micro-batch", "1e7"],
       "--micro-batch must be at most 1,000,000", "got 1e7"),
    _c("run-global-batch-1e15", ["run", MLP, "--global-batch", "1e15"],
       "--global-batch must be at most 1,000,000,000", "got 1e15"),
    _c("run-seed-huge", ["run", MLP, "--seed", "1e20"], "--seed must be at most 4,294,967,295"),
    _c("run-time-min-huge", ["run", MLP, "--slurm", "--dry-run", "--time-min", "1e9"],
       "--time-min must be a number of minutes > 0, at most 525,600 (a year), got 1e9"),
    _c("plan-tokens-1e40", ["plan", GPT, "--tokens", "1e40"], "--tokens must be at most 1e18", "got 1e40"),
    _c("plan-tokens-negative", ["plan", GPT, "--tokens", "-1e12"],
       "--tokens must be a finite number > 0, got -1e12"),
    _c("plan-samples-negative-fraction", ["plan", GPT, "--samples", "-0.5"],
       "--samples must be a finite number > 0, got -0.5"),
    _c("scale-repeat-huge", ["scale", MLP, "--gpus", "1", "--repeat", "1e6"], "--repeat must be at most 1,000"),
    _c("tune-trials-huge", ["tune", MLP, "--trials", "1e9"], "--trials must be at most 1,000"),
    _c("run-plan-file-huge-micro-batch", ["run", MLP, "--plan", "p.json"],
       "--plan p.json: its micro_batch must be at most 1,000,000", files={"p.json": json.dumps(
           {"decisions": {"strategy": "ddp", "precision": "fp32", "micro_batch": 10**9, "grad_accum": 1,
                          "checkpointing": "none", "compile": False}})}),
    # --- launches their own plan calls absurd: refused before the run dir, unless --force
    _c("run-predicted-out-of-memory", ["run", GPT, "--strategy", "ddp", "--precision", "fp32",
                                       "--micro-batch", "1000000"],
       "the plan predicts", "GiB/rank for DDP fp32 at micro-batch 1,000,000", "run out of memory", "--force"),
    _c("lab-predicted-out-of-memory", ["lab", GPT, "--micro-batch", "1000000"], "run out of memory"),
    _c("scale-predicted-out-of-memory", ["scale", GPT, "--gpus", "1,2", "--micro-batch", "1000000"],
       "run out of memory"),
    _c("run-predicted-step-absurd", ["run", MLP, "--global-batch", "1e9", "--steps", "100000"],
       "the plan predicts", "s/step", "years (the bounds: a day per step, a year per run)",
       "--force to launch anyway"),
    # --- report
    _c("report-missing-dir", ["report", "nowhere"], "nowhere", "does not exist"),
    _c("report-empty-dir", ["report", "empty"], "no runs in", dirs=("empty",)),
    _c("report-bad-format", ["report", "empty", "--format", "pdf"], "pdf", dirs=("empty",)),
    _c("report-extra-args", ["report", "empty", "--", "x"], "takes no arguments after",
       dirs=("empty",)),
]


def _tree(root: Path) -> dict[str, float]:
    return {str(p.relative_to(root)): p.stat().st_mtime for p in root.rglob("*")}


@dataclass
class Outcome:
    code: int
    err: str
    before: dict[str, float]
    after: dict[str, float]


def _run(case: Case, root: Path, cache: Path) -> Outcome:
    cwd = root / case.id
    cwd.mkdir()
    for d in case.dirs:
        (cwd / d).mkdir(parents=True)
    for rel, text in case.files.items():
        (cwd / rel).parent.mkdir(parents=True, exist_ok=True)
        (cwd / rel).write_text(text)
    before = _tree(cwd)
    env = {"PYTHONPATH": str(REPO), "DLAUNCH_CACHE_DIR": str(cache), "TMPDIR": str(root),
           "CUDA_VISIBLE_DEVICES": ""}
    done = run_dlaunch(*case.argv, cwd=cwd, env=env, timeout=240)
    return Outcome(done.code, done.err, before, _tree(cwd))


def _run_all(root: Path) -> dict[str, Outcome]:
    cache = seeded_cache(root / "cache")
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {c.id: pool.submit(_run, c, root, cache) for c in CASES}
        return {k: f.result() for k, f in futures.items()}


@pytest.fixture(scope="session")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    if "PYTEST_XDIST_WORKER" not in os.environ:  # one process: nobody to share with
        return _run_all(tmp_path_factory.mktemp("bad-input"))
    # under xdist every worker's base temp dir sits in one directory per test run
    shared = tmp_path_factory.getbasetemp().parent / "bad-input-outcomes.json"
    with FileLock(f"{shared}.lock"):  # the first worker here runs the cases; the rest wait
        if not shared.is_file():
            ran = _run_all(tmp_path_factory.mktemp("bad-input"))
            tmp = shared.with_suffix(".tmp")
            tmp.write_text(json.dumps({k: dataclasses.asdict(v) for k, v in ran.items()}))
            tmp.replace(shared)
        # floats go through JSON exactly (repr), so the mtime comparisons read as they ran
        return {k: Outcome(**v) for k, v in json.loads(shared.read_text()).items()}


def test_there_are_at_least_40_cases():
    assert len(CASES) >= 40 and len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(outcomes: dict[str, Outcome], case: Case):
    done = outcomes[case.id]
    lines = [line for line in done.err.splitlines() if line.strip()]
    assert done.code == 2, (done.code, done.err)
    assert len(lines) == 1, done.err
    assert "Traceback" not in done.err
    assert lines[0].startswith(("dlaunch: error:", "dlaunch run: error", "dlaunch: ")), lines[0]
    for needle in case.needles:
        assert needle in lines[0], (needle, lines[0])
    # nothing written: no runs/ dir, no file changed (a named run dir is left as it was)
    assert done.after == done.before, sorted(set(done.after) ^ set(done.before))


def _all(check: Callable[[Case], bool]) -> list[str]:
    return [c.id for c in CASES if check(c)]


def test_every_command_and_input_kind_is_covered():
    covered = {c.argv[0] for c in CASES if c.argv}
    assert {"run", "plan", "scale", "report", "lab", "inspect", "status", "logs", "cancel"} <= covered
    assert _all(lambda c: c.id.startswith("topology-")) and _all(lambda c: c.id.startswith("config-"))
    assert _all(lambda c: c.id.startswith("workload-"))


def test_force_launches_what_the_plan_calls_absurd(tmp_path: Path):
    # the refused out-of-memory case above, with --force: a dry run that prints the command (a
    # real run would start, and its ranks die of it)
    done = run_dlaunch("run", GPT, "--strategy", "ddp", "--precision", "fp32", "--micro-batch", "1000000",
                       "--force", "--dry-run", cwd=tmp_path,
                       env={"DLAUNCH_CACHE_DIR": str(seeded_cache(tmp_path / "cache")), "CUDA_VISIBLE_DEVICES": ""})
    assert done.code == 0, done.err
    assert "# command" in done.out and "torch.distributed.run" in done.out
    assert not (tmp_path / "runs").exists()


def test_debug_adds_the_traceback_and_keeps_the_exit_code(tmp_path: Path):
    done = run_dlaunch("--debug", "run", str(tmp_path / "nosuch.py"), "--gpus", "1", cwd=tmp_path)
    assert done.code == 2, done.err
    assert "Traceback" in done.err and "WorkloadError" in done.err
    assert done.err.rstrip().splitlines()[-1].startswith("dlaunch: error: workload file ")

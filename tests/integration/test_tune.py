"""`dlaunch tune` with real torchrun trials (2 CPU ranks, few steps): a candidate that crashes
is recorded and skipped, the fastest is written as tuned-plan.json and `run --plan` follows it,
and the next `dlaunch plan` uses the stored correction unless --no-calibration-cache.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import DATA, Done, run_dlaunch

pytestmark = pytest.mark.distributed

# mlp.py whose checkpointed blocks raise: the plan's two near-best candidates on CPU are DDP
# fp32 without and with checkpointing, so one trial trains and one crashes
CKPT_FAILS = str(DATA / "ckpt_fails.py")


@dataclass
class Tuned:
    done: Done
    tune_dir: Path
    env: dict[str, str]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> Tuned:
    root = tmp_path_factory.mktemp("tune")
    (root / "tmp").mkdir()
    env = {"TMPDIR": str(root / "tmp"), "OMP_NUM_THREADS": "1", "DLAUNCH_CACHE_DIR": str(root / "cache")}
    tune_dir = root / "t"
    done = run_dlaunch("tune", CKPT_FAILS, "--gpus", "2", "--steps", "5", "--warmup-steps", "2",
                       "--trials", "2", "--tune-dir", str(tune_dir), "--json", env=env, cwd=root)
    return Tuned(done=done, tune_dir=tune_dir, env=env)


def test_a_crashing_candidate_is_recorded_and_the_tune_finishes(tuned: Tuned) -> None:
    assert tuned.done.code == 0, tuned.done.err
    trials = tuned.done.json()["trials"]
    by_ckpt = {t["checkpointing"]: t for t in trials}
    assert by_ckpt[True]["status"] == "failed" and "injected failure" in by_ckpt[True]["reason"]
    ok = by_ckpt[False]
    assert ok["status"] == "ok" and ok["chosen"] and ok["measured_samples_per_s"] > 0
    assert ok["ratio"] == pytest.approx(ok["measured_step_s"] / ok["predicted_step_s"])
    assert "[2/2]" in tuned.done.err and "best so far: DDP fp32, mb" in tuned.done.err
    plan = json.loads((tuned.tune_dir / "tuned-plan.json").read_text())
    assert plan["decisions"]["checkpointing"] is False and plan["decisions"]["strategy"] == "ddp"


def test_run_follows_the_tuned_plan(tuned: Tuned) -> None:
    plan = json.loads((tuned.tune_dir / "tuned-plan.json").read_text())["decisions"]
    run_dir = tuned.tune_dir.parent / "followed"
    done = run_dlaunch("run", CKPT_FAILS, "--gpus", "2", "--steps", "2", "--no-calibrate", "--plan",
                       str(tuned.tune_dir / "tuned-plan.json"), "--run-dir", str(run_dir), "--json",
                       env=tuned.env, cwd=tuned.tune_dir.parent)
    assert done.code == 0, done.err
    launch = json.loads((run_dir / "launch.json").read_text())
    assert (launch["strategy"]["kind"], launch["strategy"]["precision"], launch["micro_batch"],
            launch["grad_accum_steps"], launch["strategy"]["activation_checkpointing"]) == (
        plan["strategy"], plan["precision"], plan["micro_batch"], plan["grad_accum"], plan["checkpointing"])


def test_plan_uses_the_stored_correction_unless_told_not_to(tuned: Tuned) -> None:
    measured = next(t for t in tuned.done.json()["trials"] if t["status"] == "ok")["measured_step_s"]
    args = ("plan", CKPT_FAILS, "--gpus", "2", "--precision", "fp32", "--json")
    corrected = run_dlaunch(*args, env=tuned.env).json()["plan"]
    plain = run_dlaunch(*args, "--no-calibration-cache", env=tuned.env).json()["plan"]
    assert any(r.startswith("corrected by 1 tune trial (") for r in corrected["reasons"])
    assert not any("corrected by" in r for r in plain["reasons"])
    step = lambda p: sum(p["chosen"]["time"][k] for k in ("compute_s", "comm_exposed_s", "contention_s",  # noqa: E731
                                                          "sync_wait_s"))
    # one trial: the corrected prediction of its candidate is close to its measurement
    assert step(corrected) == pytest.approx(measured, rel=0.1)
    assert corrected["chosen"]["time"]["compute_s"] != plain["chosen"]["time"]["compute_s"]

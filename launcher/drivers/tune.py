"""`dlaunch tune` without argv: measure the plan's top candidates, keep the fastest, learn.

The planner ranks every candidate but is only so accurate (`UNCERTAINTY`); the candidates it
cannot tell from the best run a short trial each, back to back like `dlaunch lab`'s runs (same
seed, same data, the same driver as `dlaunch run`). The fastest measured (samples/s) is written
as `tuned-plan.json`, which `dlaunch run --plan` follows, and the measured/predicted ratios go to
this machine's correction cache (launcher.plan.corrections). A failed trial (out of memory,
compile error, crash) is recorded with its reason and the tune goes on. Each trial's run dir
holds its own candidate's plan.json (`trial_planned`), so its result sets predicted against
measured like any `dlaunch run`, and its console output in console.log.

Under SLURM (`tune --slurm`) each trial is one SLURM job, submitted and followed exactly as
`dlaunch run --slurm`, one after another, not all trials in one allocation: a trial is then the
very job `run --slurm --plan` submits later (same shape, no second code path), the queue, limits
and accounting see ordinary jobs, and a trial that crashes, hangs to its time limit or leaves a
node bad ends its own job, not the others'. The price, a queue wait before each trial, no
measurement includes; `--budget-min` (wall time) does. A refused submission (unknown partition,
account) would refuse every trial alike: it stops the tune before anything ran (`Refused`,
raised by the backend). Never imports cli or runtime.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

from launcher.drivers.launch import RunOne
from launcher.errors import DlaunchError, Refused, UsageError
from launcher.files import atomic_write_json, open_log_stream, storage
from launcher.knobs import knobs_of
from launcher.plan.corrections import TrialRecord, compute_ratio
from launcher.plan.explain import label
from launcher.plan.kernels import KNOBS as KERNEL_KNOBS
from launcher.plan.planfile import read_plan
from launcher.plan.resolve import Planned
from launcher.plan.types import Candidate, Plan, StepInterval
from launcher.rundir import RunPaths, TunePaths
from launcher.runspec import LaunchSpec, RunSettings
from launcher.specs import TRIAL_STEPS, TRIAL_TIMED_S, checkpointing_mode

# How far apart two predicted step times (per sample) must be before the model can tell them
# apart: on CPU the probe's rates miss by 20-30% on a shared host (the measured/predicted
# spread of runs here); GPU kernels are steadier and the peak-fraction tables closer.
UNCERTAINTY = {"cpu": 0.25, "cuda": 0.15}
# Trial length when --steps is not given: at least TRIAL_STEPS (3 warm-up and 9 timed give a
# stable median for steps of a tenth of a second and more), and enough timed steps to fill
# TRIAL_TIMED_S at the fastest candidate's predicted step: nine 10 ms steps of a small model
# span less than the jitter of one rank's start, and two trials of it differed by 15%.
MAX_TRIAL_STEPS = 1000
PLAN_FORMAT = "dlaunch-tuned-plan/1"
DECISIONS = ("strategy", "precision", "micro_batch", "grad_accum", "checkpointing", "compile")
# what a plan file may also hold: files written before tensor parallelism, kernels, the reduce dtype and FSDP's
# unit lack them
FURTHER_DECISIONS = ("tp", "reduce_dtype", "fsdp_unit", *KERNEL_KNOBS.values())


def per_sample_s(c: Candidate) -> float:
    """Predicted seconds per sample: candidates with different batches compare on this."""
    return c.time.step_time_s / (c.micro_batch * c.grad_accum)


def select_trials(plan: Plan, device: str, max_trials: int) -> list[Candidate]:
    """The chosen candidate and every fitting one predicted within UNCERTAINTY of the fastest,
    fastest first, at most `max_trials`; never one predicted not to fit."""
    fitting = [c for c in (plan.chosen, *plan.rejected) if c.fits]
    best = min((per_sample_s(c) for c in fitting), default=0.0)
    near = [c for c in fitting if per_sample_s(c) <= best * (1 + UNCERTAINTY[device])]
    near.sort(key=lambda c: (c is not plan.chosen, per_sample_s(c)))  # the plan's own first
    return near[:max_trials]


def trial_steps(candidates: Sequence[Candidate], warmup_steps: int | None) -> int:
    """Optimizer steps per trial when the user gave none (see TRIAL_TIMED_S)."""
    warmup = 3 if warmup_steps is None else warmup_steps
    fastest_s = min((c.time.step_time_s for c in candidates), default=0.0)
    timed = math.ceil(TRIAL_TIMED_S / fastest_s) if fastest_s > 0 else 0
    return min(MAX_TRIAL_STEPS, max(TRIAL_STEPS, warmup + timed))


def decisions_of(c: Candidate) -> dict[str, Any]:
    """What a run needs to repeat candidate `c`."""
    s = c.strategy
    return {"strategy": s.kind, "precision": s.precision, "micro_batch": c.micro_batch, "grad_accum": c.grad_accum,
            "checkpointing": s.checkpointing, "compile": s.compile, "tp": s.tp, "reduce_dtype": s.reduce_dtype,
            "fsdp_unit": s.fsdp_unit}


def trial_name(c: Candidate) -> str:
    """'DDP fp32 + ckpt, mb 8 x 1'."""
    return f"{label(c)}, mb {c.micro_batch} x {c.grad_accum}"


def trial_spec(base: LaunchSpec, c: Candidate, index: int) -> LaunchSpec:
    """`base` with candidate `c`'s decisions, in `<tune dir>/<index>-<slug>`; no calibration
    window (the trials compare whole steps)."""
    s = c.strategy
    ckpt = {"none": "", "full": "-ckpt"}.get(s.checkpointing, f"-{s.checkpointing}")
    slug = f"{index}-{s.kind}-{s.precision}{ckpt}-mb{c.micro_batch}"
    return dataclasses.replace(base, run_id=f"{base.run_id}-{slug}", run_dir=str(Path(base.run_dir) / slug),
                               micro_batch=c.micro_batch, grad_accum=c.grad_accum,
                               strategy=s.kind, precision=s.precision, checkpointing=s.checkpointing,
                               compile=s.compile or base.compile, fsdp_unit=s.fsdp_unit, calibrate=False)


def trial_planned(planned: Planned, c: Candidate) -> Planned:
    """`planned` as if its plan had chosen `c`: the plan.json of `c`'s trial, so the trial's
    result sets `c`'s own prediction against its measurement, as a `dlaunch run` does."""
    p, t = planned.plan, c.time
    samples = c.micro_batch * c.grad_accum * p.world_size
    why = f"tune trial of {trial_name(c)}: predicted within the model's uncertainty of the best"
    plan = dataclasses.replace(p, chosen=dataclasses.replace(c, reason=why), reasons=(why,), global_batch=samples,
                               rejected=tuple(x for x in (p.chosen, *p.rejected) if x is not c),
                               units_per_s=samples * planned.profile.units_per_sample / t.step_time_s,
                               scaling_efficiency=t.compute_s / t.step_time_s if t.step_time_s else 1.0,
                               step_interval=p.step_interval and p.step_interval.around(t.step_time_s))
    return dataclasses.replace(planned, plan=plan)


@dataclass(frozen=True, kw_only=True)
class Trial:
    """One measured (or failed, or skipped) candidate."""

    name: str
    candidate: Candidate
    run_dir: str
    status: str  # ok | failed | skipped
    reason: str = ""
    measured_step_s: float | None = None
    measured_samples_per_s: float | None = None

    @property
    def ratio(self) -> float | None:
        """Measured over predicted step time."""
        return None if self.measured_step_s is None else self.measured_step_s / self.candidate.time.step_time_s

    def to_dict(self, world_size: int, chosen: bool, interval: StepInterval | None = None) -> dict[str, Any]:
        """JSON-ready row of the table (with the plan's `interval` around this trial's prediction)."""
        c = self.candidate
        around = interval.around(c.time.step_time_s) if interval else None
        return {"name": self.name, **decisions_of(c), "predicted_step_s": c.time.step_time_s,
                "predicted_interval_s": [around.low_s, around.high_s] if around else None,
                "predicted_samples_per_s": c.micro_batch * c.grad_accum * world_size / c.time.step_time_s,
                "measured_step_s": self.measured_step_s,
                "measured_samples_per_s": self.measured_samples_per_s, "ratio": self.ratio,
                "status": self.status, "reason": self.reason, "run_dir": self.run_dir, "chosen": chosen}


@dataclass(frozen=True, kw_only=True)
class TuneResult:
    """Every trial, the fastest measured, and where the tuned plan went."""

    tune_dir: str
    world_size: int
    trials: tuple[Trial, ...]
    tuned_plan: str | None  # None: no trial finished
    interval: StepInterval | None = None  # the plan's interval around its chosen step time

    @property
    def best(self) -> Trial | None:
        """The trial with the highest measured samples/s."""
        ok = [t for t in self.trials if t.status == "ok" and t.measured_samples_per_s]
        return max(ok, key=lambda t: t.measured_samples_per_s or 0.0, default=None)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the table's rows and the outcome."""
        best = self.best
        return {"tune_dir": self.tune_dir, "world_size": self.world_size, "tuned_plan": self.tuned_plan,
                "chosen": best.name if best else None,
                "trials": [t.to_dict(self.world_size, t is best, self.interval) for t in self.trials]}


def run_trials(base: LaunchSpec, candidates: Sequence[Candidate], *, run: RunOne, budget_s: float | None = None,
               keep_plan: Callable[[LaunchSpec, Candidate], None] | None = None,
               progress: IO[str] = sys.stderr) -> tuple[Trial, ...]:
    """Run each candidate's trial in turn (`run(spec, console)`, the driver's `Runner`, its
    console into the trial's console.log); a failed one is recorded and the next starts.
    `keep_plan(spec, candidate)` writes the trial's plan.json once its run dir exists. Once
    `budget_s` has gone no further trial starts (the rest are recorded as skipped). `Refused`
    from the first trial propagates: nothing ran, and every other trial would be refused alike."""
    t0, k = time.monotonic(), len(candidates)
    trials: list[Trial] = []
    for i, c in enumerate(candidates, 1):
        spec, name = trial_spec(base, c, i), trial_name(c)
        trial = functools.partial(Trial, name=name, candidate=c, run_dir=spec.run_dir)
        if budget_s is not None and trials and time.monotonic() - t0 >= budget_s:
            trials.append(trial(status="skipped", reason=f"--budget-min reached ({budget_s / 60:g} min)"))
            continue
        progress.write(f"dlaunch tune: [{i}/{k}] {name} (predicted {c.time.step_time_s:.3g} s/step) ...\n")
        progress.flush()
        paths = RunPaths(root=spec.run_dir)
        with storage(paths.root):
            paths.root.mkdir(mode=0o750, parents=True, exist_ok=True)
        if keep_plan is not None:
            keep_plan(spec, c)
        try:
            with open_log_stream(paths.console_log) as console:
                result = run(spec, console)
        except DlaunchError as e:  # refused before launching (a spec this machine cannot run)
            if isinstance(e, Refused) and not trials:
                raise
            trials.append(trial(status="failed", reason=str(e)))
        else:
            if result.status == "ok" and result.samples_per_s > 0:
                trials.append(trial(status="ok", measured_step_s=result.step_time_median_s,
                                    measured_samples_per_s=result.samples_per_s))
            else:  # its first two failures: under SLURM the job's state, then the failing rank's exception
                trials.append(trial(status="failed", reason="; ".join(result.failures[:2]) if result.failures
                                    else f"{result.status}, exit code {result.exit_code}"))
        last = trials[-1]
        best = TuneResult(tune_dir=base.run_dir, world_size=base.world_size, trials=tuple(trials), tuned_plan=None).best
        outcome = f"{last.measured_samples_per_s:,.1f} samples/s" if last.status == "ok" else f"FAILED: {last.reason}"
        progress.write(f"dlaunch tune: [{i}/{k}] {outcome}; best so far: "
                       f"{f'{best.name} ({best.measured_samples_per_s:,.1f} samples/s)' if best else 'none'}\n")
        progress.flush()
    return tuple(trials)


def discard(tune_dir: str) -> None:
    """Take back a tune dir in which no trial ran (its first was `Refused`): what the tune wrote
    (each trial's plan.json and console.log, the claim) goes, other files stay."""
    tune = TunePaths(root=tune_dir)
    for trial in (d for d in tune.root.iterdir() if d.is_dir()):
        paths = RunPaths(root=trial)
        for path in (paths.plan, paths.console_log):
            path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # only if now empty
            trial.rmdir()
    tune.owner.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        tune.root.rmdir()


def finish(base: LaunchSpec, trials: Sequence[Trial], *, workload: str, workload_args: Sequence[str],
           interval: StepInterval | None = None) -> TuneResult:
    """Write tuned-plan.json (when a trial finished) and tune.json in the tune dir."""
    tune = TuneResult(tune_dir=base.run_dir, world_size=base.world_size, trials=tuple(trials), tuned_plan=None,
                      interval=interval)
    best = tune.best
    if best is not None:
        path = TunePaths(root=base.run_dir).tuned_plan
        kernels = {k: getattr(base, k) for k in KERNEL_KNOBS.values() if getattr(base, k) is not None}
        atomic_write_json(path, {
            "format": PLAN_FORMAT, "workload": workload, "workload_args": list(workload_args), "device": base.device,
            "nodes": base.nodes, "gpus": base.gpus, "decisions": {**decisions_of(best.candidate), **kernels},
            "name": best.name, "measured_samples_per_s": best.measured_samples_per_s,
            "predicted_step_s": best.candidate.time.step_time_s, "trials": len(trials),
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds")})
        tune = dataclasses.replace(tune, tuned_plan=str(path))
    atomic_write_json(TunePaths(root=base.run_dir).record, tune.to_dict())
    return tune


def trial_records(tune: TuneResult, workload: str, workload_args: Sequence[str] = ()) -> list[TrialRecord]:
    """The finished trials as the correction cache stores them."""
    at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return [TrialRecord(precision=t.candidate.strategy.precision,
                        compute_ratio=compute_ratio(t.candidate.time, t.measured_step_s),
                        step_ratio=t.measured_step_s / t.candidate.time.step_time_s,
                        predicted_step_s=t.candidate.time.step_time_s, measured_step_s=t.measured_step_s,
                        workload=Path(workload).name, workload_args=tuple(workload_args), tune_dir=tune.tune_dir, at=at)
            for t in tune.trials if t.status == "ok" and t.measured_step_s]


def read_plan_file(path: str) -> dict[str, Any]:
    """The decisions of a plan file: a tune's tuned-plan.json or a run dir's plan.json."""
    try:
        data = json.loads(Path(path).expanduser().read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UsageError(f"--plan {path}: not a readable JSON plan file ({e})") from None
    if isinstance(data, Mapping) and isinstance(data.get("decisions"), Mapping):
        found = dict(data["decisions"])
    elif isinstance(data, Mapping) and isinstance(data.get("plan"), Mapping) and "chosen" in data["plan"]:
        try:
            found = {k: getattr(read_plan(data), k) for k in (*DECISIONS, *FURTHER_DECISIONS)}
        except (KeyError, TypeError, ValueError) as e:
            raise UsageError(f"--plan {path}: a malformed plan.json ({type(e).__name__}: {e})") from None
    else:
        raise UsageError(f"--plan {path}: neither a tuned-plan.json nor a run dir's plan.json")
    if missing := [k for k in DECISIONS if found.get(k) is None]:
        raise UsageError(f"--plan {path}: no {', '.join(missing)} in it")
    # each number against its knob's check here, so the line names the file, not a flag not given
    for name, k in knobs_of(RunSettings).items():
        if k.check is not None and found.get(name) is not None:
            k.check.validate(f"--plan {path}: its {name}", found[name])
    # a plan file written before the checkpointing modes holds a bool (true: every block)
    return {**{k: checkpointing_mode(found[k]) if k == "checkpointing" else found[k] for k in DECISIONS},
            **{k: found[k] for k in FURTHER_DECISIONS if found.get(k) is not None}}

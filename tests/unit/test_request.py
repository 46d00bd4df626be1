"""RunRequest: validation, the plan filling only the decisions left open, the LaunchSpec it makes,
and `dlaunch scale` planning like `run` unless the flags decide."""

from __future__ import annotations

import dataclasses
import json

import pytest

from launcher.errors import DlaunchError, PlanError, UsageError
from launcher.hardware.topology import load_topology
from launcher.plan.resolve import Planned
from launcher.plan.search import plan
from launcher.plan.types import Overrides
from launcher.request import RunRequest
from launcher.runspec import RunSettings
from launcher.specs import Goal, ModelProfile

from tests.helpers import DATA, WORKLOADS, run_dlaunch

MLP = str(WORKLOADS / "mlp.py")
GPT = str(WORKLOADS / "gpt.py")
# big enough that its activations, not its weights, decide the micro-batch on a 1-core CPU node
PROFILE = ModelProfile(name="toy", num_params=10**6, bytes_by_dtype={"fp32": 4 * 10**6}, num_blocks=4,
                       largest_block_params=250_000, activation_bytes_per_sample=1e6,
                       block_input_bytes_per_sample=1e4, flops_fwd_per_sample=1e9)


def planned(request: RunRequest) -> Planned:
    topo = load_topology("cpu-local").with_shape(num_nodes=1, devices_per_node=request.gpus)
    overrides = Overrides(strategy=request.strategy, precision=request.precision,
                          micro_batch=request.micro_batch)
    return Planned(plan=plan(PROFILE, topo, Goal(), overrides=overrides), profile=PROFILE, topology=topo)


@pytest.mark.parametrize("field, value, needle", [
    ("steps", 0, "`steps` must be an integer >= 1, got 0"),
    ("gpus", 0, "`gpus` must be an integer >= 1"),
    ("nodes", 0, "`nodes` must be an integer >= 1"),
    ("micro_batch", 0, "`micro_batch` must be an integer >= 1"),
    ("grad_accum", -1, "`grad_accum` must be an integer >= 1"),
    ("global_batch", 0, "`global_batch` must be an integer >= 1"),
    ("warmup_steps", 20, "`warmup_steps` must be below `steps` (20), got 20"),
    ("strategy", "zero3", "unknown strategy 'zero3'"),
    ("precision", "fp8", "unknown precision 'fp8'"),
    ("device", "tpu", "device must be one of"),
])
def test_bad_requests_are_refused_where_they_are_made(field, value, needle):
    with pytest.raises(UsageError) as e:
        RunRequest(workload=MLP, **{field: value})
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_plain_scripts_warm_up_is_not_bounded_by_steps_it_cannot_set():
    # a script runs the steps it likes (`--steps` is for workloads): 25 warm-up steps are its to count
    request = RunRequest(workload=MLP, is_script=True, warmup_steps=25)
    assert request.launch_spec(run_id="r", run_dir="/RUN").warmup_steps == 25
    with pytest.raises(UsageError, match="must be below"):
        dataclasses.replace(request, is_script=False)


def test_a_planned_request_leaves_nothing_open():
    request = RunRequest(workload=MLP, gpus=2)
    done = request.with_plan(planned(request))
    with pytest.raises(PlanError, match="leaves no decision open"):
        dataclasses.replace(done, strategy=None)


def test_the_plan_fills_only_what_was_left_open():
    request = RunRequest(workload=MLP, gpus=2, strategy="fsdp_full", grad_accum=4)
    assert request.open_decisions == ("precision", "micro_batch")
    done = request.with_plan(planned(request))
    chosen = done.planned.plan.chosen
    assert (done.strategy, done.grad_accum) == ("fsdp_full", 4)  # the user's, kept
    assert (done.precision, done.micro_batch) == (chosen.strategy.precision, chosen.micro_batch)
    assert done.plan_note.startswith("dlaunch: plan: FSDP")
    spec = done.launch_spec(run_id="r", run_dir="/RUN")
    assert (spec.strategy, spec.grad_accum, spec.micro_batch) == ("fsdp_full", 4, chosen.micro_batch)


def test_a_run_with_every_decision_given_is_planned_for_its_prediction_only():
    from launcher.request import follow_plan

    request = RunRequest(workload=MLP, gpus=2, strategy="fsdp_full", precision="bf16", micro_batch=4)
    done = follow_plan(request)
    chosen = done.planned.plan.chosen
    # the plan is the run's own: the given decisions and the fallbacks of the rest
    assert (chosen.strategy.kind, chosen.strategy.precision, chosen.micro_batch) == ("fsdp_full", "bf16", 4)
    assert (chosen.grad_accum, chosen.strategy.checkpointing) == (
        RunSettings().decided()["grad_accum"], RunSettings().decided()["checkpointing"])
    assert chosen.time.step_time_s > 0
    # nothing was chosen for the user: no note, the request's fields as given
    assert done.plan_note is None and dataclasses.replace(done, planned=None) == request


def test_what_nothing_decided_takes_the_fallbacks():
    spec = RunRequest(workload=MLP, steps=2, hang_timeout_s=1000.0).launch_spec(run_id="r", run_dir="/RUN")
    assert (spec.strategy, spec.precision, spec.micro_batch, spec.grad_accum,
            spec.checkpointing, spec.tp) == tuple(RunSettings().decided()[k] for k in (
                "strategy", "precision", "micro_batch", "grad_accum", "checkpointing", "tp"))
    assert spec.warmup_steps == 1 and spec.startup_timeout_s == 1000.0  # min(3, steps - 1); max(900, hang)


def test_the_settings_check_a_knob_against_the_others_where_they_are_made():
    with pytest.raises(DlaunchError, match="`shard_group_size` applies to `strategy` hybrid only"):
        RunRequest(workload=MLP, strategy="ddp", shard_group_size=2)
    # what only the spec knows (the world size) the spec checks
    request = RunRequest(workload=MLP, strategy="hybrid", shard_group_size=3, gpus=2)
    with pytest.raises(DlaunchError, match="`shard_group_size` must divide the world size"):
        request.launch_spec(run_id="r", run_dir="/RUN")


def _sweep_header(done) -> str:
    assert done.code == 0, done.err
    return next(line for line in done.out.splitlines() if line.startswith("# sweep"))


def test_scale_follows_the_plan_unless_flags_decide(dlaunch):
    # gpt medium on this CPU: the plan's micro-batch (1 on an ordinary host) is not the old fixed 8
    env = {"CUDA_VISIBLE_DEVICES": ""}
    plan_out = dlaunch("plan", GPT, "--gpus", "2", "--json", "--", "--size", "medium", env=env)
    assert plan_out.code == 0, plan_out.err
    chosen = json.loads(plan_out.out)["plan"]["chosen"]
    done = dlaunch("scale", GPT, "--gpus", "1,2", "--dry-run", "--", "--size", "medium", env=env)
    header = _sweep_header(done)
    assert f"strategy {chosen['strategy']['kind']}, precision {chosen['strategy']['precision']}" in header
    assert f"ws2-r0: 2 rank(s) = 1 node(s) x 2, micro-batch {chosen['micro_batch']}," in done.out
    assert "dlaunch: plan: " in done.err
    # flags decide: nothing left to plan, no plan note, the flags' values in every point
    fixed = dlaunch("scale", GPT, "--gpus", "1,2", "--dry-run", "--strategy", "fsdp_grad_op",
                    "--precision", "bf16", "--micro-batch", "3", "--", "--size", "medium", env=env)
    assert "strategy fsdp_grad_op, precision bf16" in _sweep_header(fixed)
    assert "ws1-r0: 1 rank(s) = 1 node(s) x 1, micro-batch 3," in fixed.out
    assert "dlaunch: plan" not in fixed.err


def test_what_a_workload_prints_while_planned_stays_off_dlaunchs_output(capsys, tmp_path, monkeypatch):
    from launcher.request import follow_plan

    monkeypatch.setenv("DLAUNCH_CACHE_DIR", str(tmp_path))  # profiled and step-probed afresh
    chatty = str(DATA / "steady.py")
    request = RunRequest(workload=chatty, workload_args=("--step-sleep-s", "0", "--chatter", "3"), gpus=1,
                         strategy="ddp", precision="fp32", micro_batch=2)
    assert follow_plan(request).planned is not None
    out, err = capsys.readouterr()
    assert "chatter" not in out and "chatter" not in err
    # the workload did run here: profiled, and its steps timed (the prints were held, not skipped)
    [timed] = (tmp_path / "steps").iterdir()
    assert "failed" not in json.loads(timed.read_text())


def test_a_library_logging_while_the_workload_is_profiled_stays_off_dlaunchs_stderr(tmp_path):
    # a GPU topology: the model is built on the meta device, no step probe
    args = ["plan", str(DATA / "steady.py"), "--topology", "h100-sxm-8x", "--gpus", "1", "--", "--chatter", "1"]
    quiet = run_dlaunch(*args, env={"DLAUNCH_CACHE_DIR": str(tmp_path / "quiet")})
    assert quiet.code == 0 and "chatter from a library" not in quiet.out + quiet.err, quiet.err
    # --debug shows it, and its library's errors always pass
    loud = run_dlaunch(args[0], "--debug", *args[1:], env={"DLAUNCH_CACHE_DIR": str(tmp_path / "loud")})
    assert loud.code == 0 and "WARNING chatty.lib: chatter from a library's logger" in loud.err, loud.err[-2000:]


def test_a_forced_launch_inside_the_plans_headroom_is_warned_of_and_one_past_the_card_refused():
    from launcher.cli.prepare import refuse_absurd

    topo = load_topology("cpu-local").with_shape(num_nodes=1, devices_per_node=1)
    request = RunRequest(workload=MLP, gpus=1, strategy="ddp", precision="fp32", micro_batch=64)
    forced = Overrides(strategy="ddp", precision="fp32", micro_batch=64, checkpointing="none", compile=False)

    def launch(headroom: float, micro_batch: int = 64) -> RunRequest:
        ov = dataclasses.replace(forced, micro_batch=micro_batch)
        p = plan(PROFILE, topo, Goal(headroom=headroom), overrides=ov)
        return dataclasses.replace(request, micro_batch=micro_batch,
                                   planned=Planned(plan=p, profile=PROFILE, topology=topo))

    roomy = launch(0.1).planned.plan.chosen
    share = roomy.memory.total_bytes / (topo.accelerator.mem_gib * 2**30)
    assert roomy.fits and 0 < share < 0.5
    tight = launch(1 - share / 2)  # the same plan, past a headroom that leaves half of what it needs
    assert not tight.planned.plan.chosen.fits
    assert tight.planned.plan.reasons[0].startswith("warning: the forced plan leaves less than the")
    refuse_absurd(tight, force=False)  # launched: the note carries the warning
    past = launch(0.1, micro_batch=int(64 / share * 2))  # twice the card
    with pytest.raises(PlanError, match=r"GiB each has: the ranks would run out of memory"):
        refuse_absurd(past, force=False)
    refuse_absurd(past, force=True)

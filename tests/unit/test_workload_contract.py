"""The workload contract beyond the required three functions, without torchrun: neighbour
imports, the meta-device error that says whether the workload fails on CPU too, the optional
make_optimizer / make_scheduler / evaluate, and the memory model's optimizer state by type."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from launcher.errors import WorkloadError
from launcher.plan.memory import estimate_memory
from launcher.plan.profile import profile_workload
from launcher.specs import ModelProfile, Strategy
from launcher.workload import load_workload

from tests.helpers import DATA, WORKLOADS, assert_one_line_error

# a nanoGPT-style pair: the model in model.py, the workload file importing it as a neighbour
MODEL_PY = '''
import torch
from torch import nn


class GPT(nn.Module):
    def __init__(self, vocab=64, dim=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx):
        return self.head(self.embed(idx))


class Chars(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import codec  # another neighbour, imported where the sample is read (a worker)
        return codec.encode(i)
'''
CODEC_PY = '''
import torch


def encode(i):
    return (torch.arange(17) * (i % 5 + 1)) % 64
'''
TRAIN_PY = '''
import torch.nn.functional as F
from model import GPT, Chars


def build_model(cfg):
    return GPT()


def make_dataset(cfg, num_samples):
    return Chars(num_samples)


def loss_fn(model, batch):
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
'''


def nanogpt_dir(root: Path) -> Path:
    """A folder holding train.py, model.py and codec.py; returns train.py's path."""
    root.mkdir(parents=True, exist_ok=True)
    for name, text in (("model.py", MODEL_PY), ("codec.py", CODEC_PY), ("train.py", TRAIN_PY)):
        (root / name).write_text(textwrap.dedent(text))
    return root / "train.py"


def test_a_workload_imports_its_neighbours_in_the_launcher(dlaunch, tmp_path):
    """`from model import GPT` works where the launcher profiles the workload (`dlaunch plan`)."""
    train = nanogpt_dir(tmp_path / "nanogpt")
    done = dlaunch("plan", str(train), "--gpus", "1", cwd=tmp_path)
    assert done.code == 0, done.err
    assert "Plan for train" in done.out


def test_load_workload_puts_the_folder_first_on_sys_path(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "contract_sibling_x.py").write_text("VALUE = 41\n")
    (tmp_path / "w.py").write_text(textwrap.dedent('''
        from contract_sibling_x import VALUE
        def build_model(cfg): return VALUE + 1
        def make_dataset(cfg, n): return []
        def loss_fn(model, batch): return 0
    '''))
    try:
        w = load_workload(tmp_path / "w.py")
        assert w.build_model() == 42
        assert sys.path[0] == str(tmp_path)
    finally:
        sys.modules.pop("contract_sibling_x", None)


# ---- the meta-device error ------------------------------------------------------------------


def test_a_bug_that_fails_on_cpu_too_is_not_blamed_on_meta():
    with pytest.raises(WorkloadError) as err:
        profile_workload(load_workload(DATA / "view_bug.py"))
    msg = str(err.value)
    assert "fails on CPU too" in msg and "view size is not compatible" in msg, msg
    assert "meta-safe" not in msg


def test_a_meta_only_failure_says_how_to_be_meta_safe():
    with pytest.raises(WorkloadError) as err:
        profile_workload(load_workload(DATA / "meta_unsafe.py"))
    msg = str(err.value)
    assert "fails only on the meta device" in msg and ".item()" in msg and "meta-safe" in msg, msg


def test_the_cpu_too_error_is_one_line_from_the_cli(dlaunch):
    done = dlaunch("plan", str(DATA / "view_bug.py"), "--gpus", "1")
    assert_one_line_error(done, "view_bug.py fails on CPU too", "RuntimeError: view size")


# ---- make_optimizer / make_scheduler / evaluate ---------------------------------------------

OPTIMIZER_WORKLOAD = '''
import torch
from torch import nn


def build_model(cfg):
    return nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))


def make_dataset(cfg, n):
    return [(torch.randn(16), 0) for _ in range(n)]


def loss_fn(model, batch):
    return model(batch[0]).sum()

{extra}
'''


def workload_with(tmp_path: Path, extra: str) -> Path:
    path = tmp_path / "opt_workload.py"
    path.write_text(OPTIMIZER_WORKLOAD.format(extra=textwrap.dedent(extra)))
    return path


PARAMS = 16 * 16 + 16 + 16 * 4 + 4


@pytest.mark.parametrize("extra, name, state_bytes, fused", [
    ("", "AdamW (default)", 8.0, None),
    ("def make_optimizer(cfg, model):\n    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)\n",
     "SGD (make_optimizer)", 4.0, False),
    ("def make_optimizer(cfg, model):\n    return torch.optim.SGD(model.parameters(), lr=0.1)\n",
     "SGD (make_optimizer)", 0.0, False),
    ("def make_optimizer(cfg, model):\n    return torch.optim.Adam(model.parameters(), amsgrad=True, fused=True)\n",
     "Adam (make_optimizer)", 12.0, True),
    # only the second layer trains: the first layer's parameters hold no state
    ("def make_optimizer(cfg, model):\n    return torch.optim.SGD(model[1].parameters(), lr=0.1, momentum=0.9)\n",
     "SGD (make_optimizer)", 4.0 * (16 * 4 + 4) / PARAMS, False),
])
def test_the_profile_measures_the_optimizer_state_by_type(tmp_path, extra, name, state_bytes, fused):
    profile = profile_workload(load_workload(workload_with(tmp_path, extra)))
    assert profile.optimizer == name and profile.optimizer_fused is fused
    assert profile.optimizer_state_bytes_per_param == pytest.approx(state_bytes)
    est = estimate_memory(profile, Strategy(), micro_batch=1, world_size=2, shard_group_size=1,
                          device="cpu")
    assert est.optimizer_bytes == pytest.approx(state_bytes * PARAMS)
    assert f"{name} state {state_bytes:g} = {8 + state_bytes:g} B/param" in est.assumptions


def test_a_profile_without_the_optimizer_assumes_the_goals():
    """Profiles made elsewhere (tests, older caches) name no optimizer: `optimizer` is assumed."""
    p = ModelProfile(name="m", num_params=1000, bytes_by_dtype={"float32": 4000}, num_blocks=0,
                     largest_block_params=0, activation_bytes_per_sample=0.0,
                     block_input_bytes_per_sample=0.0, flops_fwd_per_sample=1.0)
    est = estimate_memory(p, Strategy(), micro_batch=1, world_size=2, shard_group_size=1,
                          device="cpu", optimizer="sgd")
    assert est.optimizer_bytes == 4000 and "sgd (assumed) state 4" in est.assumptions


def test_the_plan_states_the_workloads_optimizer(dlaunch):
    done = dlaunch("plan", str(DATA / "sgd_cosine.py"), "--gpus", "1")
    assert done.code == 0, done.err
    assert "SGD (make_optimizer) state 4 = 12 B/param" in done.out


@pytest.mark.parametrize("extra, needle", [
    ("def make_optimizer(cfg, model):\n    return [1]\n", "make_optimizer() returned list"),
    ("def make_scheduler(cfg, optimizer):\n    return 3\n", "make_scheduler() returned int"),
    ("def evaluate(model, cfg):\n    return 0.5\n", "evaluate() returned float"),
    ("def make_optimizer(cfg, model):\n    raise KeyError('lr')\n", "make_optimizer() raised KeyError"),
])
def test_bad_optional_functions_are_workload_errors(tmp_path, extra, needle):
    w = load_workload(workload_with(tmp_path, extra))
    model = w.build_model()
    with pytest.raises(WorkloadError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        w.make_scheduler(w.make_optimizer(model))
        w.evaluate(model)


def test_the_defaults_are_adamw_and_no_scheduler(tmp_path):
    import torch

    w = load_workload(workload_with(tmp_path, ""))
    optimizer = w.make_optimizer(w.build_model())
    assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["lr"] == 1e-3
    assert w.make_scheduler(optimizer) is None and not w.has_evaluate


def test_evaluate_returns_floats(tmp_path):
    w = load_workload(workload_with(tmp_path, "def evaluate(model, cfg):\n"
                                               "    return {'acc': torch.tensor(0.25), 'n': 3}\n"))
    assert w.has_evaluate and w.evaluate(w.build_model()) == {"acc": 0.25, "n": 3.0}


def test_eval_every_is_validated(dlaunch, tmp_path):
    mlp = str(WORKLOADS / "mlp.py")
    plan = ("--strategy", "ddp", "--precision", "fp32", "--micro-batch", "4", "--dry-run")
    assert_one_line_error(dlaunch("run", mlp, "--eval-every", "-1", *plan, cwd=tmp_path),
                          "--eval-every must be an integer >= 0")
    assert_one_line_error(dlaunch("run", str(DATA / "plain_train.py"), "--eval-every", "2", *plan,
                                  cwd=tmp_path), "--eval-every needs a workload")
    # a knob the script's own loop would ignore is refused, never silently dropped; the ones
    # dlaunch applies around the script (placement, timeouts, restarts) are taken
    script = str(DATA / "plain_train.py")
    for given, said in ((("--steps", "50"), "--steps 50 is for workloads"),
                        (("--profile",), "--profile is for workloads"),
                        (("--strategy", "fsdp_full"), "--strategy fsdp_full is for workloads")):
        done = dlaunch("run", script, *given, "--dry-run", cwd=tmp_path)
        assert_one_line_error(done, said)
        assert "give the script its own flag after `--`" in done.err and not (tmp_path / "runs").exists()
    done = dlaunch("run", script, "--hang-timeout-s", "30", "--max-restarts", "1", "--gpus", "2", "--dry-run",
                   cwd=tmp_path)
    assert done.code == 0, done.err
    done = dlaunch("run", str(DATA / "sgd_cosine.py"), "--eval-every", "5", *plan, cwd=tmp_path)
    assert done.code == 0, done.err
    assert '"eval_every": 5' in done.out


def test_eval_every_without_evaluate_fails_before_training(tmp_path):
    from launcher.runspec import LaunchSpec
    from launcher.runtime.evaluation import check

    spec = LaunchSpec(workload=str(WORKLOADS / "mlp.py"), run_id="r", run_dir=str(tmp_path),
                      eval_every=3)
    with pytest.raises(WorkloadError, match=r"--eval-every 3: workload mlp.py defines no evaluate"):
        check(load_workload(WORKLOADS / "mlp.py"), spec)

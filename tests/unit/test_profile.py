"""The meta-device profile: a model of identical blocks is measured through its first blocks and
scaled; the result must equal profiling every block, and models where scaling would be wrong
(blocks indexed by a configured count, blocks whose costs grow) must fall back to every block."""

import logging
import textwrap

import pytest
import torch

from launcher.plan.profile import profile_workload
from launcher.workload import linear_layers, load_workload

from tests.helpers import WORKLOADS

EXTRAPOLATION_FAILED = "profiling every block"

# a stack of identical blocks; FORWARD is the model's forward body
WORKLOAD = """
import torch
import torch.nn.functional as F
from torch import nn

DEFAULTS = {{"depth": 6}}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return F.gelu(self.fc(x))


class Net(nn.Module):
    def __init__(self, depth):
        super().__init__()
        self.depth = depth
        self.layers = nn.ModuleList(Block() for _ in range(depth))
        self.out = nn.Linear(16, 4)

    def forward(self, x):
{forward}
        return self.out(x)


def build_model(cfg):
    return Net(cfg.depth)


def blocks(model):
    return list(model.layers)


def make_dataset(cfg, num_samples):
    return [(torch.randn(16), 0) for _ in range(num_samples)]


def loss_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)
"""

FORWARDS = {
    # iterates the container: extrapolation applies
    "iterates": "for layer in self.layers:\n    x = layer(x)",
    # indexes by the configured depth: a truncated container raises IndexError
    "indexes": "for i in range(self.depth):\n    x = self.layers[i](x)",
    # each block runs over every earlier output (dense connections): costs grow with depth
    "dense": ("outs = [x]\nfor layer in self.layers:\n"
              "    outs.append(layer(torch.cat(outs))[: x.shape[0]])\nx = outs[-1]"),
}


def _workload(tmp_path, kind):
    path = tmp_path / f"{kind}.py"
    path.write_text(WORKLOAD.format(forward=textwrap.indent(FORWARDS[kind], " " * 8)))
    return load_workload(path)


@pytest.mark.parametrize("kind, extrapolated", [("iterates", True), ("indexes", False), ("dense", False)])
def test_extrapolated_profile_equals_every_block(tmp_path, caplog, kind, extrapolated):
    workload = _workload(tmp_path, kind)
    with caplog.at_level(logging.DEBUG, logger="launcher.plan.profile"):
        fast = profile_workload(workload)
    assert (EXTRAPOLATION_FAILED not in caplog.text) == extrapolated, caplog.text
    full = profile_workload(workload, extrapolate=False)
    assert fast == full
    assert fast.num_blocks == 6 and fast.activation_bytes_per_sample > 0 and fast.flops_fwd_per_sample > 0


@pytest.mark.parametrize("size", ["small", "llama3-8b"])
def test_gpt_profile_extrapolates_exactly(size):
    workload = load_workload(WORKLOADS / "gpt.py", ["--size", size])
    assert profile_workload(workload) == profile_workload(workload, extrapolate=False)


def test_blocks_are_restored_after_truncation():
    from torch import nn

    from launcher.plan.blocks import first_blocks

    layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(5))
    before = list(layers)
    with pytest.raises(RuntimeError), first_blocks(layers, 2):
        assert list(layers) == before[:2]
        raise RuntimeError("a forward that fails mid-profile")
    assert list(layers) == before and [name for name, _ in layers.named_children()] == list("01234")


def test_linear_units_are_each_blocks_linear_layers_and_its_rest():
    # a SwiGLU block of dim 64 and ffn 192: q, k, v, o (64 x 64), three 64 x 192 MLP weights and two norms (the
    # block's rest): 8 units under --fsdp-unit linear, the largest an MLP weight
    workload = load_workload(WORKLOADS / "gpt.py", ["--size", "tiny", "--dim", "64", "--heads", "2", "--kv-heads", "2",
                                                    "--ffn", "192", "--vocab", "256"])
    p = profile_workload(workload)
    assert (p.linear_unit_params, p.linear_units_per_block) == (64 * 192, 8)
    assert p.largest_block_params == 4 * 64 * 64 + 3 * 64 * 192 + 2 * 64
    # an MoE's experts (linear layers in a module list, called per routed token) stay in the block's unit
    moe = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3)))
    assert linear_layers(moe) == [moe[0]]


def test_plan_seq_len_scales_the_profile_as_profiling_at_that_length():
    """`plan --seq-len` re-prices a profile taken at the workload's own length: what scales with
    tokens (saved activations, the loss gradient over the vocabulary) must land where profiling
    at the longer length does."""
    from launcher.plan.candidates import profile_for_goal
    from launcher.specs import Goal

    args = ["--size", "tiny", "--attention", "sdpa"]
    short = profile_workload(load_workload(WORKLOADS / "gpt.py", [*args, "--seq-len", "64"]))
    long = profile_workload(load_workload(WORKLOADS / "gpt.py", [*args, "--seq-len", "256"]))
    moved = profile_for_goal(short, Goal(seq_len=256))
    assert long.backward_transient_bytes_per_sample == pytest.approx(4 * short.backward_transient_bytes_per_sample)
    assert moved.backward_transient_bytes_per_sample == pytest.approx(long.backward_transient_bytes_per_sample)
    assert moved.activation_bytes_per_sample == pytest.approx(long.activation_bytes_per_sample, rel=0.02)

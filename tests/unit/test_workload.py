"""The workload loader: every way a file can be wrong gives one clear WorkloadError."""

from pathlib import Path

import pytest

from launcher.errors import WorkloadError
from launcher.workload import inspect_file, load_workload, parse_options

from tests.helpers import DATA, WORKLOADS


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.mark.parametrize("name", ["gpt.py", "mlp.py", "resnet.py"])
def test_shipped_workloads_load_and_build_on_meta(name):
    import torch

    w = load_workload(WORKLOADS / name)
    with torch.device("meta"):
        model = w.build_model()
    assert sum(p.numel() for p in model.parameters()) > 0
    assert len(w.blocks(model)) >= 2
    assert len(w.make_dataset(4)) == 4


def test_missing_file(tmp_path):
    with pytest.raises(WorkloadError, match="does not exist"):
        inspect_file(tmp_path / "nope.py")


def test_syntax_error_names_line(tmp_path):
    p = write(tmp_path, "bad.py", "def build_model(cfg):\n    return (\n")
    with pytest.raises(WorkloadError, match=r"syntax error at line \d"):
        inspect_file(p)


def test_partial_contract_names_missing(tmp_path):
    p = write(tmp_path, "part.py", "def build_model(cfg): pass\ndef loss_fn(m, b): pass\n")
    with pytest.raises(WorkloadError, match=r"but not make_dataset; .* \(a plain script: --script\)"):
        inspect_file(p)
    assert inspect_file(p, force_script=True).is_script  # what that says


def test_neither_workload_nor_script(tmp_path):
    p = write(tmp_path, "x.py", "X = 1\n")
    with pytest.raises(WorkloadError, match="neither a workload.*--script runs it as one"):
        inspect_file(p)


def test_plain_script_detected():
    assert inspect_file(DATA / "plain_train.py").is_script


def test_raises_on_import(tmp_path):
    p = write(tmp_path, "boom.py", "raise RuntimeError('no data mounted')\n"
              "def build_model(cfg): pass\ndef make_dataset(c, n): pass\ndef loss_fn(m, b): pass\n")
    with pytest.raises(WorkloadError, match="raised on import: RuntimeError: no data mounted"):
        load_workload(p)


def test_options_typed_and_unknown_rejected():
    defaults = {"size": "tiny", "layers": 2, "lr": 0.1, "fast": False}
    cfg = parse_options(defaults, ["--size", "small", "--layers=4", "--lr", "1e-3", "--fast"], source="w")
    assert cfg == {"size": "small", "layers": 4, "lr": 1e-3, "fast": True}
    with pytest.raises(WorkloadError, match="unknown option --depth"):
        parse_options(defaults, ["--depth", "3"], source="w")
    with pytest.raises(WorkloadError, match="expects a int"):
        parse_options(defaults, ["--layers", "four"], source="w")


def test_gpt_presets_reach_llama_shapes():
    import torch

    w = load_workload(WORKLOADS / "gpt.py", ["--size", "llama3-8b"])
    with torch.device("meta"):
        n = sum(p.numel() for p in w.build_model().parameters())
    assert 7.9e9 < n < 8.1e9  # Llama-3 8B has 8.03e9 parameters
    assert w.units_per_sample == 8192


def test_optimizer_kwargs_are_the_settings_a_constructor_takes():
    import torch

    from launcher.workload import optimizer_kwargs

    adamw = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=0.1)
    kept = optimizer_kwargs(torch.optim.AdamW, adamw.defaults)
    assert kept["lr"] == 0.1 and set(kept) <= set(adamw.defaults)
    assert "decoupled_weight_decay" in adamw.defaults and "decoupled_weight_decay" not in kept

    class Wrapped(torch.optim.SGD):  # takes **kwargs: every setting passes through
        def __init__(self, params, **kwargs):
            super().__init__(params, **kwargs)

    assert optimizer_kwargs(Wrapped, {"lr": 0.1, "momentum": 0.9}) == {"lr": 0.1, "momentum": 0.9}

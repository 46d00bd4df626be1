"""torch.compile in the ranks: compiled and eager DDP training agree, a compile failure falls
back to eager (or fails under --compile-strict), and graphs / breaks / recompiles are counted.

Compile on 2 CPU cores is slow (20-30 s cold per graph): the model is the small MLP, the runs
are short, and Inductor's cache lives in .pytest_cache so a second session starts warm.
"""

import os

import pytest

from tests.helpers import DATA, REPO, assert_one_line_error, rank_losses, run_result

MLP = str(REPO / "workloads" / "mlp.py")
# shared across test sessions (git-ignored): a warm cache turns 20-30 s compiles into 3-7 s
INDUCTOR_CACHE = os.environ.get("DLAUNCH_TEST_INDUCTOR_CACHE",
                                str(REPO / ".pytest_cache" / "dlaunch-inductor"))


def run_mlp(dlaunch, run_dir, *extra):
    done = dlaunch("run", MLP, "--gpus", "2", "--strategy", "ddp", "--precision", "fp32",
                   "--micro-batch", "8", "--steps", "6", "--warmup-steps", "1", "--no-calibrate",
                   "--run-dir", str(run_dir), *extra, env={"TORCHINDUCTOR_CACHE_DIR": INDUCTOR_CACHE})
    assert done.code == 0, done.out + done.err
    return done


@pytest.mark.distributed
def test_compiled_ddp_matches_eager(dlaunch, tmp_path):
    run_mlp(dlaunch, tmp_path / "eager")
    # strict: fullgraph=True, so any graph break would fail the run
    done = run_mlp(dlaunch, tmp_path / "compiled", "--compile-strict")
    eager, compiled = rank_losses(tmp_path / "eager"), rank_losses(tmp_path / "compiled")
    # Inductor fuses and reorders fp32 arithmetic: 1e-7 relative measured, fp32's bar is 1e-4
    worst = max(abs(a - b) / abs(a) for a, b in zip(eager, compiled))
    assert len(compiled) == 6 and worst < 1e-4, (worst, eager, compiled)
    result = run_result(tmp_path / "compiled")
    r0 = result["ranks"][0]
    assert r0["compiled_graphs"] >= 1 and r0["graph_breaks"] == 0 and r0["recompiles"] == 0
    assert r0["compile_fallback"] is None
    assert "compile: 1 graph(s), 0 graph break(s), 0 recompilation(s) on rank 0" in done.out


@pytest.mark.distributed
def test_compile_failure_falls_back_to_eager(dlaunch, tmp_path):
    done = dlaunch("run", str(DATA / "compile_fails.py"), "--compile", "--steps", "3",
                   "--strategy", "ddp", "--precision", "fp32", "--micro-batch", "4",
                   "--run-dir", str(tmp_path / "run"), env={"TORCHINDUCTOR_CACHE_DIR": INDUCTOR_CACHE})
    assert done.code == 0, done.out + done.err
    warnings = [line for line in done.out.splitlines() if "dlaunch: warning: torch.compile failed" in line]
    assert len(warnings) == 1 and "dlaunch_test::twice has no fake kernel" in warnings[0]
    assert "WARNING: torch.compile failed on rank(s) 0; they ran eagerly" in done.out
    result = run_result(tmp_path / "run")
    assert result["status"] == "ok" and result["ranks"][0]["steps"] == 3
    assert "TorchRuntimeError" in result["ranks"][0]["compile_fallback"]


def test_compile_guard_strict_raises_and_default_falls_back():
    """In-process: the guard retries eagerly once, or raises CompileFailed under strict."""
    import importlib.util

    import torch

    from launcher.runtime.compiling import CompileFailed, CompileGuard

    spec = importlib.util.spec_from_file_location("compile_fails_unit", DATA / "compile_fails.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    x = torch.randn(2, 16)
    strict = mod.Net()
    strict.forward = torch.compile(strict.forward, backend="eager", fullgraph=True)
    with pytest.raises(CompileFailed, match="--compile-strict.*TorchRuntimeError"):
        CompileGuard(compiled=True, strict=True, rank=1).run(lambda: strict(x), lambda: None)
    lenient = mod.Net()
    lenient.forward = torch.compile(lenient.forward, backend="eager")
    resets = []
    guard = CompileGuard(compiled=True, strict=False, rank=1)
    try:
        out = guard.run(lambda: lenient(x), lambda: resets.append(1))
    finally:
        torch.compiler.set_stance("default")
    assert out.shape == (2, 4) and resets == [1] and guard.fallback and not guard.watching
    # a model error is not a compile error: it propagates untouched
    with pytest.raises(ZeroDivisionError):
        CompileGuard(compiled=True, strict=False, rank=1).run(lambda: 1 / 0, lambda: None)


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_cuda_graph_modes_are_refused_with_fsdp(dlaunch, mode):
    done = dlaunch("run", MLP, "--strategy", "fsdp_full", "--precision", "fp32", "--micro-batch", "4",
                   "--compile-mode", mode, "--dry-run")
    assert_one_line_error(done, f"--compile-mode {mode} captures CUDA graphs", "FSDP")

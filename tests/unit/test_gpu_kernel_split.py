"""benchmarks/gpu_kernel_split.py: CUDA kernel names sorted into the cost model's kinds of work."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_kernel_split", ROOT / "benchmarks" / "gpu_kernel_split.py")
split_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(split_mod)


def test_kernel_names_fall_into_the_models_kinds():
    # names as the CUDA profiler records them on an H100 (torch 2.11)
    assert split_mod.kind_of("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "matmul"
    assert split_mod.kind_of("nvjet_hsh_128x256_64x4_1x2_h_bz_coopB_NNT") == "matmul"
    assert split_mod.kind_of("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>") == "attention"
    assert split_mod.kind_of("fmha_cutlassB_f32_aligned_64x64_k64_sm80") == "attention"
    assert split_mod.kind_of("ncclDevKernel_AllReduce_Sum_f32_RING_LL") == "communication"
    assert split_mod.kind_of("void at::native::(anonymous namespace)::multi_tensor_apply_kernel") == "optimizer"
    assert split_mod.kind_of("void at::native::vectorized_elementwise_kernel<4, GeluCUDAKernelImpl>") == "memory-bound"


def test_split_sums_device_time_per_profiled_step(tmp_path):
    trace = tmp_path / "trace-rank0.json"
    trace.write_text(json.dumps({"traceEvents": [
        {"cat": "kernel", "name": "sm90_xmma_gemm", "dur": 3000},
        {"cat": "kernel", "name": "flash_bwd_kernel", "dur": 1500},
        {"cat": "kernel", "name": "vectorized_elementwise_kernel", "dur": 600},
        {"cat": "gpu_memcpy", "name": "Memcpy HtoD", "dur": 30},
        {"cat": "cpu_op", "name": "aten::mm", "dur": 99999},  # host time is not device time
    ]}))
    got = split_mod.split(trace, steps=3)
    assert got == pytest.approx({"matmul": 0.001, "attention": 0.0005, "memory-bound": 0.0002, "copies": 0.00001})

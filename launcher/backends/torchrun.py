"""The torchrun command line and the environment dlaunch adds for the ranks.

Shared by the local backend (one node, rendezvous on loopback) and the SLURM backend (one
torchrun per node, rendezvous on the first node), so both start ranks the same way. Pure
functions of a `LaunchSpec`: nothing is started here. Never imports `launcher.runtime` (the rank
entry is named as a string), drivers, cli or report.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from launcher.alloc_conf import alloc_conf_env, installed_torch_version
from launcher.backends import RANK_ENTRY_MODULE, SCRIPT_BOOTSTRAP_MODULE
from launcher.hardware.types import rank_threads
from launcher.hardware.visible import cuda_order_env
from launcher.rundir import CHECKPOINT_DIR_ENV, RunPaths, checkpoint_dir
from launcher.runspec import LaunchSpec

# the checkout this package runs from: ranks import it from there even when it is not installed
REPO_ROOT = Path(__file__).resolve().parents[2]
# torchrun prefixes every rank's output lines with this; the local backend routes lines by it
LINE_PREFIX = "[rank ${rank}] "


def rank_env(spec: LaunchSpec, *, base_env: Mapping[str, str], cores: int) -> dict[str, str]:
    """The variables dlaunch adds for the ranks (the user's own settings win)."""
    env: dict[str, str] = {
        "DLAUNCH_RUN_DIR": spec.run_dir,
        "DLAUNCH_RUN_ID": spec.run_id,
        "DLAUNCH_WARMUP_STEPS": str(spec.warmup_steps),
        "PYTHONUNBUFFERED": "1",
        "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": LINE_PREFIX,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), base_env.get("PYTHONPATH", "")) if p),
    }
    # set but empty is unset (as OpenMP reads it): each rank would otherwise take every core
    if not base_env.get("OMP_NUM_THREADS", "").strip():
        env["OMP_NUM_THREADS"] = str(rank_threads(cores, spec.gpus))
    if spec.device == "cpu" and "ACCELERATE_USE_CPU" not in base_env:
        # Hugging Face Accelerate forms a (gloo) process group on CPU only when told: without
        # it, `Accelerator()` in each CPU rank trains its own unsynchronised copy
        env["ACCELERATE_USE_CPU"] = "1"
    if spec.device == "cuda":
        # under the name the ranks' torch reads (this interpreter's: the backends start ranks
        # with it); nothing when the user set either name, in the shell or in the spec's env
        env.update(alloc_conf_env({**spec.env, **base_env}, installed_torch_version()))
        env.update(cuda_order_env({**spec.env, **base_env}))  # cuda:i is NVML's GPU i
    if spec.max_restarts > 0 or spec.checkpoint_every > 0:
        # where the harness saves and, on a restart (DLAUNCH_RESUME=1), resumes from
        # (runtime.resume); the same variable the SLURM backend sets
        env[CHECKPOINT_DIR_ENV] = str(checkpoint_dir(spec.run_dir, base_env))
    for k, v in spec.env.items():
        env.setdefault(k, v)
    return env


def torchrun_argv(spec: LaunchSpec, *, python: str, rdzv_endpoint: str, node_rank: int = 0, log_dir: str) -> list[str]:
    """The torchrun command line shared by the local and the SLURM backend."""
    argv = [python, "-m", "torch.distributed.run", "--nnodes", str(spec.nodes), "--nproc-per-node", str(spec.gpus),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", spec.run_id,
            "--max-restarts", "0", "--log-dir", log_dir, "--tee", "3"]
    if spec.nodes > 1:
        argv += ["--node-rank", str(node_rank)]
    if spec.is_script:  # run unchanged, measured by the bootstrap's hooks
        argv += ["-m", SCRIPT_BOOTSTRAP_MODULE, spec.workload, *spec.workload_args]
    else:
        argv += ["-m", RANK_ENTRY_MODULE, str(RunPaths(root=spec.run_dir).launch)]
    return argv

"""Glue between a workload file, a topology and the pure planner (no argv here).

`resolve_topology` picks the hardware to plan for (a topology file, or this machine), reshaped
to the requested GPUs and nodes; `plan_workload` profiles the workload on the meta device and
plans it. Profiles are cached by the workload file's contents, its arguments and the torch
version, so `dlaunch run` after the first plan does not import torch before launching.

Never imports cli, backends, jobs, runtime or report, and never torch itself (`profile` loads
it when a profile is not cached).
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from launcher.errors import UsageError
from launcher.files import atomic_write_json
from launcher.hardware.detect import detect_topology
from launcher.hardware.topology import load_topology
from launcher.hardware.types import Topology
from launcher.plan.profile import profile_workload
from launcher.plan.search import plan
from launcher.plan.types import Plan
from launcher.specs import Goal, ModelProfile
from launcher.workload import load_workload

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Planned:
    """A plan with what it was made from."""

    plan: Plan
    profile: ModelProfile
    topology: Topology


def resolve_topology(*, topology: str | None, gpus: int | None, nodes: int | None) -> Topology:
    """The topology file (or this machine), with `gpus` per node and `nodes` nodes."""
    if topology is not None:
        topo = load_topology(topology)
        source = f"topology {topo.name}"
    else:
        topo = detect_topology()
        source = "this machine"
    per_node = topo.devices_per_node if gpus is None else gpus
    if topo.device == "cuda" and per_node > topo.devices_per_node:
        raise UsageError(f"--gpus {per_node} is more than {source} has per node "
                         f"({topo.devices_per_node}); use --gpus {topo.devices_per_node} or fewer")
    num_nodes = topo.num_nodes if nodes is None else nodes
    if num_nodes > 1 and topo.inter_node is None:
        raise UsageError(f"--nodes {num_nodes}: {source} describes no link between nodes; "
                         "give a multi-node --topology file (ls topologies/)")
    if (per_node, num_nodes) != (topo.devices_per_node, topo.num_nodes):
        topo = topo.with_shape(num_nodes=num_nodes, devices_per_node=per_node)
    return topo


def profile_cache_dir() -> Path:
    """Where profiles are cached: $DLAUNCH_CACHE_DIR/profiles, else ~/.cache/dlaunch/profiles."""
    root = os.environ.get("DLAUNCH_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dlaunch")
    return Path(root) / "profiles"


def _cache_key(workload: str, workload_args: Sequence[str]) -> str:
    h = hashlib.sha256(Path(workload).read_bytes())
    try:
        torch_version = metadata.version("torch")  # no torch import: this must stay fast
    except metadata.PackageNotFoundError:
        torch_version = "none"
    h.update(json.dumps([list(workload_args), torch_version, _PROFILE_FORMAT]).encode())
    return h.hexdigest()[:32]


# bump when profile.py measures differently, so old cache entries are ignored
_PROFILE_FORMAT = 3


def cached_profile(workload: str, workload_args: Sequence[str]) -> ModelProfile:
    """The workload's profile, from the cache when its file, arguments and torch are unchanged."""
    path = profile_cache_dir() / f"{_cache_key(workload, workload_args)}.json"
    try:
        return ModelProfile(**json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        pass  # absent or stale: profile again
    # importing torch and torch._dynamo (meta kernels import it) allocates ~1M objects and the
    # cyclic GC rescans them over and over: 0.5 s of a 2.5 s cold `dlaunch plan`. Nothing here
    # builds garbage cycles worth collecting, so collection waits until the profile is done.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        profile = profile_workload(load_workload(workload, workload_args))
    finally:
        if gc_was_enabled:
            gc.enable()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, dataclasses.asdict(profile))
    except OSError as e:  # a read-only home must not stop planning
        log.debug("profile cache not written: %s", e)
    return profile


def plan_workload(workload: str, workload_args: Sequence[str], topology: Topology, goal: Goal, *,
                  overrides: Mapping[str, Any] | None = None) -> Planned:
    """Profile `workload` on the meta device (or take the cached profile) and plan it."""
    profile = cached_profile(workload, workload_args)
    return Planned(plan=plan(profile, topology, goal, overrides=overrides), profile=profile,
                   topology=topology)

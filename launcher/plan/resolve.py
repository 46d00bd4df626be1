"""Glue between a workload file, a topology and the pure planner (no argv here).

`resolve_topology` picks the hardware to plan for (a topology file, or this machine), reshaped
to the requested GPUs and nodes, with a CPU's rates measured by `cpu_probe` and the gloo
collectives between its ranks by `gloo_probe` (both cached per host);
`plan_workload` profiles the workload on the meta device (and, for a GPU plan, traces one
forward with Dynamo: `compile_probe`) and plans it, its predicted compute corrected by this
machine's `dlaunch tune` trials when there are any (`corrections`; the trials are stored with
`store_tune_trials`). Profiles are cached by the workload file's contents, its arguments and
the torch version, so `dlaunch run` after the first plan does not import torch before launching.

Never imports cli, backends, jobs, runtime or report, and never torch itself (`profile`,
`cpu_probe` and `gloo_probe` load it when their cache entry is missing).
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import hashlib
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import psutil

from launcher.errors import PlanError, UsageError, stopped_while
from launcher.files import atomic_write_json
from launcher.hardware.detect import cpu_info, detect_topology
from launcher.hardware.topology import load_topology
from launcher.hardware.types import MEASURED_HOST_BW, Host, Topology
from launcher.plan import cpu_probe, step_probe
from launcher.plan.candidates import precisions_for
from launcher.plan.compile_probe import COMPILE_PROBE_FORMAT, CompileCheck, check_compile
from launcher.plan.corrections import Correction, TrialRecord, correction_of, fingerprint, load_trials, store_trials
from launcher.plan.cpu_cost import cpu_step_time
from launcher.plan.cpu_rates import CpuRates, GlooRates, HostStream
from launcher.plan.gloo_probe import GLOO_PROBE_FORMAT, measure_gloo
from launcher.plan.host_quiet import IGNORE_LOAD_ENV, Quiet, cacheable, watch
from launcher.plan.kernels import with_kernels
from launcher.plan.profile import Profiled, profiled_workload
from launcher.plan.search import plan
from launcher.plan.step_child import StepProbeFailed, probe_in_child
from launcher.plan.types import Overrides, Plan
from launcher.specs import Goal, ModelProfile, Strategy
from launcher.workload import Workload, load_workload, workload_prints_held

log = logging.getLogger(__name__)
_T = TypeVar("_T")
# what the step probe times: the precisions CPU plans choose between
PROBE_PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True, kw_only=True)
class Planned:
    """A plan with what it was made from."""

    plan: Plan
    profile: ModelProfile
    topology: Topology
    correction: Correction | None = None  # this machine's tune trials, when they were applied


@stopped_while("planning")  # its probes take seconds: a SIGTERM meanwhile says so
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
    if topo.device == "cpu":
        # what this host's cores achieve replaces the listed (or ISA-derived) peak, and what
        # gloo costs between its ranks the link's figures (one node: the ranks share this host;
        # between nodes the link is the network's; one rank: DDP still hands each bucket to
        # gloo); GPU topologies never pay for these probes
        gloo = _gloo_or_none(topo.devices_per_node) if topo.num_nodes == 1 else None
        topo = cpu_probe.probed_topology(topo, cached_cpu_rates(), gloo)
    if topology is None and topo.host is not None:
        topo = dataclasses.replace(topo, host=measured_host(topo, cached_host_stream()))
    return topo


def measured_host(topo: Topology, stream: HostStream) -> Host:
    """This machine's host side with its memory bandwidth measured (on a CPU node, its link too: the copies
    stay in that memory), not the assumed figure: CPU offload's host step runs at it."""
    host = topo.host
    assert host is not None
    link = host.link_gb_s if topo.device == "cuda" else stream.gb_s
    return Host(mem_gib=host.mem_gib, link_gb_s=link, mem_bw_gb_s=stream.gb_s,
                source=host.source.split("; memory bandwidth")[0] + f"; memory bandwidth {stream.gb_s:g} "
                       f"{MEASURED_HOST_BW}, {stream.measured_at})")


def cache_root() -> Path:
    """dlaunch's cache: $DLAUNCH_CACHE_DIR, else $XDG_CACHE_HOME/dlaunch or ~/.cache/dlaunch."""
    return Path(os.environ.get("DLAUNCH_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dlaunch"))


def profile_cache_dir() -> Path:
    """Where profiles are cached: <cache root>/profiles."""
    return cache_root() / "profiles"


def probe_cache_dir() -> Path:
    """Where the CPU probe's rates are cached: <cache root>/cpu-probe."""
    return cache_root() / "cpu-probe"


def step_cache_dir() -> Path:
    """Where the step probe's timings are cached: <cache root>/steps."""
    return cache_root() / "steps"


def corrections_path(topology: Topology) -> Path:
    """This machine's tune trials: <cache root>/corrections/<fingerprint>.json."""
    return cache_root() / "corrections" / f"{fingerprint(topology, cpu_probe.torch_version())}.json"


def store_tune_trials(topology: Topology, trials: Sequence[TrialRecord]) -> Path:
    """Add measured tune trials to this machine's corrections (the trusted ones: see plan.corrections)."""
    path = corrections_path(topology)
    store_trials(path, trials)
    return path


def _cache_key(workload: str, workload_args: Sequence[str]) -> str:
    h = hashlib.sha256(Path(workload).read_bytes())
    h.update(json.dumps([list(workload_args), cpu_probe.torch_version(), _PROFILE_FORMAT]).encode())
    return h.hexdigest()[:32]


# bump when profile.py measures differently, so old cache entries are ignored
# 8: profile_note; 9: math_attention_bytes_per_sample; 11: kernels; 12: selective_saved_share; 13: tp_loss_parallel;
# 14: linear_unit_params; 15: attention written out detected; 16: its scores softmaxed into fp32; 17: optimizer_fused
_PROFILE_FORMAT = 17


def _cached(path: Path, load: Callable[[dict[str, Any]], _T], make: Callable[[], _T]) -> _T:
    """The cache entry at `path` (a JSON dataclass), made and stored when absent or stale."""
    try:
        return load(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError, KeyError):
        pass  # absent or stale: make it again
    value = make()
    _store(path, dataclasses.asdict(value))  # type: ignore[call-overload]
    return value


def _cached_probe(path: Path, load: Callable[[dict[str, Any]], _T], make: Callable[[], _T],
                  what: str, wanted_cores: float) -> _T:
    """`_cached` for a measurement of this host: stored only when the host was quiet while it
    ran (`host_quiet`) and the result is plausible (its `implausible()`, where it has one); a busy
    host's measurement serves this plan alone, and a line says so. A cached one that is not
    plausible is measured again. With the load ignored (`IGNORE_LOAD_ENV`: a test suite, in a
    cache of its own) both are kept as measured."""
    keep_all = os.environ.get(IGNORE_LOAD_ENV) == "1"
    try:
        cached = load(json.loads(path.read_text(encoding="utf-8")))
        if keep_all or _doubt(cached) is None:
            return cached
    except (OSError, ValueError, TypeError):
        pass  # absent or stale: measure
    value, quiet = watch(make, cpu_info().usable_cores, wanted_cores)
    if not cacheable(quiet):
        _say_busy(what, quiet)
    elif not keep_all and (doubt := _doubt(value)) is not None:
        log.warning("dlaunch measured %s implausibly (%s; %s): used for this plan only, not cached; plan "
                    "again on an idle host to keep a measurement", what, doubt, quiet.describe())
    else:
        _store(path, dataclasses.asdict(value))  # type: ignore[call-overload]
    return value


def _doubt(value: object) -> str | None:
    """Why a probe's result cannot be this host's own (its `implausible()`), or None."""
    implausible = getattr(value, "implausible", None)
    return implausible() if callable(implausible) else None


def _say_busy(what: str, quiet: Quiet) -> None:
    log.warning("the host was busy while dlaunch measured %s (%s): used for this plan only, not "
                "cached; plan again on an idle host to keep a measurement", what, quiet.describe())


def _measured_without_gc(what: str, measure: Callable[[Workload], _T], workload: str,
                         workload_args: Sequence[str]) -> _T:
    """`measure` of the loaded workload, its prints held and the cyclic GC off: importing torch
    and torch._dynamo (meta kernels import it) allocates ~1M objects and the GC rescans them
    over and over (0.5 s of a 2.5 s cold `dlaunch plan`). Nothing here builds garbage cycles
    worth collecting, so collection waits until the measurement is done."""
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        with workload_prints_held(what):
            return measure(load_workload(workload, workload_args))
    finally:
        if gc_was_enabled:
            gc.enable()


def cached_profiled(workload: str, workload_args: Sequence[str]) -> Profiled:
    """The workload's profile and its kernels' sources, from the cache when its file, arguments
    and torch are unchanged."""
    path = profile_cache_dir() / f"{_cache_key(workload, workload_args)}.json"
    return _cached(path, lambda d: Profiled(profile=_profile_from_json(d["profile"]),
                                            kernel_sources=dict(d["kernel_sources"])),
                   lambda: _measured_without_gc("its profile", profiled_workload, workload, workload_args))


def _profile_from_json(d: dict[str, Any]) -> ModelProfile:
    """A cached profile: JSON has no tuples, and ModelProfile's tp_degrees is one."""
    return ModelProfile(**{**d, "tp_degrees": tuple(d.get("tp_degrees", ()))})


def compile_cache_path(workload: str, workload_args: Sequence[str]) -> Path:
    """Where the workload's Dynamo trace is cached: beside the profile, same key."""
    return profile_cache_dir() / f"{_cache_key(workload, workload_args)}-compile-v{COMPILE_PROBE_FORMAT}.json"


def cached_compile_check(workload: str, workload_args: Sequence[str]) -> CompileCheck:
    """Dynamo's trace of one forward of the workload on the meta device (`compile_probe`), from
    the cache when its file, arguments and torch are unchanged."""
    return _cached(compile_cache_path(workload, workload_args), lambda d: CompileCheck(**d),
                   lambda: _measured_without_gc("its compile check", check_compile, workload, workload_args))


def cached_cpu_rates(cache_dir: Path | None = None, *, measure_fn: Callable[[], CpuRates] = cpu_probe.measure,
                     gemm_fn: Callable[[], float] = cpu_probe.quick_gemm_gflops) -> CpuRates:
    """This host's CPU rates (`cpu_probe`), measured once per CPU model, usable cores and torch
    version and cached in `cache_dir` (default `probe_cache_dir()`); an entry older than a day
    or from other CPU flags is re-validated by one quick re-measure on a quiet host, and
    measured again when that moved (`cpu_probe.revalidate`)."""
    info = cpu_info()
    key = cpu_probe.cache_key(info.model, info.usable_cores, cpu_probe.torch_version())
    path = (cache_dir or probe_cache_dir()) / f"{key}.json"
    flags = cpu_probe.flags_digest(info.flags)

    def load(d: dict[str, Any]) -> CpuRates:
        rates = CpuRates(**d)
        now = datetime.datetime.now()
        if not cpu_probe.needs_revalidation(rates, now, flags):
            return rates
        gemm, quiet = watch(gemm_fn, info.usable_cores, 1)
        if not cacheable(quiet):  # a busy host's re-measure decides nothing
            return rates
        valid = cpu_probe.revalidate(rates, gemm, now, flags)
        if valid is None:
            raise ValueError("the cached CPU probe no longer holds")  # measure again
        _store(path, dataclasses.asdict(valid))
        return valid

    return _cached_probe(path, load, measure_fn, "its CPU rates", info.usable_cores)


def cached_host_stream(cache_dir: Path | None = None, *,
                       measure_fn: Callable[[], HostStream] = cpu_probe.host_stream) -> HostStream:
    """This node's memory bandwidth (`cpu_probe.host_stream`), measured once per CPU model, usable
    cores and torch version."""
    info = cpu_info()
    key = cpu_probe.cache_key(info.model, info.usable_cores, cpu_probe.torch_version())
    path = (cache_dir or probe_cache_dir()) / f"host-stream-{key}.json"
    return _cached_probe(path, lambda d: HostStream(**d), measure_fn, "its host memory bandwidth", info.usable_cores)


def cached_gloo_rates(ranks: int, cache_dir: Path | None = None, *,
                      measure_fn: Callable[[int], GlooRates] = measure_gloo) -> GlooRates:
    """What gloo collectives cost between `ranks` busy ranks of this host (`gloo_probe`),
    measured once per CPU model, usable cores, torch version and rank count."""
    info = cpu_info()
    key = cpu_probe.cache_key(info.model, info.usable_cores, cpu_probe.torch_version())
    path = (cache_dir or probe_cache_dir()) / f"gloo-{key}-{ranks}-v{GLOO_PROBE_FORMAT}.json"
    return _cached_probe(path, lambda d: GlooRates(**d), lambda: measure_fn(ranks), "its gloo collectives", ranks)


def _gloo_or_none(ranks: int) -> GlooRates | None:
    """`cached_gloo_rates`, or None (the link's own alpha-beta figures) when the probe fails:
    a plan must not die of its measurement, as with the step probe."""
    try:
        return cached_gloo_rates(ranks)
    except Exception as e:  # the probe runs gloo, threads and sockets: anything can go wrong
        log.warning("gloo probe failed (%s: %s); planning with the link's listed figures", type(e).__name__, e)
        return None


def _probe_sizes(profile: ModelProfile, topology: Topology, precisions: Sequence[str]) -> tuple[int, ...]:
    """The micro-batches the step probe may time for `profile` in `precisions` on one rank of `topology`
    (`step_probe.probe_micro_batches`), or () when the model is too big to build here."""
    state = profile.param_bytes * 2 + profile.num_params * profile.optimizer_state_bytes_per_param
    if state > min(step_probe.MAX_STATE_BYTES, 0.25 * psutil.virtual_memory().available):
        return ()
    one = dataclasses.replace(topology, devices_per_node=1, num_nodes=1, cpu_cores_per_node=topology.rank_threads)
    step_s = {}
    for mb in {1, *step_probe.MICRO_BATCHES}:
        if profile.activation_bytes_per_sample * mb + state > step_probe.MAX_STATE_BYTES:
            continue
        step_s[mb] = max(cpu_step_time(profile, Strategy(precision=p.removesuffix(step_probe.FP32_NORMS)), one, mb, 1,
                                       group_size=1, recompute=0.0).step_time_s for p in precisions)
    return step_probe.probe_micro_batches(step_s, len(precisions))


def cached_step_timing(workload: str, workload_args: Sequence[str], profile: ModelProfile, topology: Topology,
                       precisions: Sequence[str] = PROBE_PRECISIONS) -> step_probe.WorkloadTiming | None:
    """The workload's own steps timed on this host with a rank's thread count (`step_probe`), each
    of `precisions` measured once per workload, host and thread count; None for a GPU or multi-node
    topology, a model too big or too slow to time here, or a workload that fails when timed."""
    if topology.device != "cpu" or topology.num_nodes != 1:
        return None
    threads = topology.rank_threads
    info = cpu_info()
    host = cpu_probe.cache_key(info.model, info.usable_cores, cpu_probe.torch_version())
    key = f"{_cache_key(workload, workload_args)}-{host}-t{threads}-v{step_probe.STEP_PROBE_FORMAT}"
    path = step_cache_dir() / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"
    needed, have = step_probe.probe_precisions(precisions, profile.batch_norms), None
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(stored, dict) and "failed" in stored:
            log.debug("step probe of %s failed before (%s); planning from the CPU rates",
                      profile.name, stored["failed"])
            return None
        have = step_probe.WorkloadTiming.from_dict(stored)
        if set(needed) <= set(have.precisions):
            return have
    except (OSError, ValueError, TypeError, KeyError, PlanError):
        pass  # absent or stale: measure
    missing = tuple(p for p in needed if have is None or p not in have.precisions)
    sizes = _probe_sizes(profile, topology, missing)
    if not sizes:
        log.debug("step probe skipped for %s: too big or too slow to time here", profile.name)
        return have
    try:
        # in a child process: the workload's code may hang, exit or flood its streams there
        timing, quiet = watch(lambda: probe_in_child(
            workload, workload_args, threads=threads, precisions=missing,
            micro_batches=sizes), info.usable_cores, threads)
    except Exception as e:  # noqa: BLE001 - a workload bug surfaces in the run, with its traceback
        why = str(e) if isinstance(e, StepProbeFailed) else f"{type(e).__name__}: {e}"
        log.warning("timing %s's steps failed (%s); planning from the CPU rates without them", profile.name, why)
        # remembered like a timing (the key holds the workload file's hash): an edited workload
        # is timed again, an unchanged one does not re-import torch and fail at every plan
        if have is None:
            _store(path, {"failed": f"{type(e).__name__}: {e}"})
        return have
    timing = dataclasses.replace(timing, precisions={**(have.precisions if have else {}), **timing.precisions})
    if cacheable(quiet):
        _store(path, step_probe.as_cached(timing))
    else:
        _say_busy(f"{profile.name}'s steps", quiet)
    return timing


def _store(path: Path, data: Mapping[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, data)
    except OSError as e:  # a read-only home must not stop planning
        log.debug("cache entry %s not written: %s", path, e)


@stopped_while("planning")
def plan_workload(workload: str, workload_args: Sequence[str], topology: Topology, goal: Goal, *,
                  overrides: Overrides | None = None, corrected: bool = True) -> Planned:
    """Profile `workload` on the meta device (or take the cached profile) and plan it, on a CPU
    host from its own timed steps, on GPUs with Dynamo's trace of one forward deciding compile
    (unless the overrides decide it); unless `corrected` is False, with this machine's tune
    corrections of this workload's predicted compute (what the overrides force stays forced)."""
    profiled = cached_profiled(workload, workload_args)
    profile = profiled.profile
    timing = cached_step_timing(workload, workload_args, profile, topology,
                                precisions_for(topology, overrides or Overrides()))
    # compile is the plan's to decide on a GPU unless the user decided it
    compile_open = (overrides is None or overrides.compile is None) and topology.device == "cuda"
    check = cached_compile_check(workload, workload_args) if compile_open else None
    correction = (correction_of(load_trials(corrections_path(topology)), workload=Path(workload).name,
                                workload_args=workload_args) if corrected else None)
    result = plan(profile, topology, goal, overrides=overrides, timing=timing, compile_check=check,
                  compute_factor=None if correction is None else correction.factor,
                  correction_note="" if correction is None else correction.describe(),
                  kernel_sources=profiled.kernel_sources)
    return Planned(plan=result, profile=with_kernels(profile, result.kernels), topology=topology, correction=correction)

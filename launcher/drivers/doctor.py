"""`dlaunch doctor` without argv: start the doctor's ranks, collect what they measured, judge it.

The ranks are a plain torchrun script (`DOCTOR_RANK`) in a `LaunchSpec` of their own, launched
by the driver of every run (`drivers.launch`) on the command's backend, so they start exactly as
a run's ranks do: on this host (keeper, live `[rank N]` lines, the heartbeat watcher that ends a
hung doctor and names the rank, Ctrl-C) with OMP_NUM_THREADS set per rank as for a run
(`hardware.types.rank_threads`); on SLURM as one job of one torchrun per node. Ranks that died
get their summary from `backends.postmortem`, so each is named with why.

What the ranks should have measured comes from `expectation_topology` (before anything starts:
a bad --topology is refused first) and `launcher.plan.expected`; the verdicts from
`launcher.results.doctor`, written to RUN_DIR/doctor.json. Never imports cli or runtime.
"""

from __future__ import annotations

import io
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from launcher.backends.base import Backend, Placement
from launcher.backends.torchrun import REPO_ROOT
from launcher.drivers.launch import launch
from launcher.errors import UsageError
from launcher.files import atomic_write_json
from launcher.hardware.topology import load_topology
from launcher.hardware.types import Topology
from launcher.plan.cpu_probe import torch_version
from launcher.plan.cpu_rates import ProbedCpu, gloo_of
from launcher.plan.expected import Expectations, cpu_expectations, gpu_expectations, no_expectations
from launcher.plan.resolve import resolve_topology
from launcher.results.doctor import DEFAULT_THRESHOLD, DoctorReport, RankReading, judge, read_readings
from launcher.rundir import create_run_dir
from launcher.runspec import LaunchSpec, RunSettings

# the rank program, by path (torchrun runs it as a script; drivers never import the runtime)
DOCTOR_RANK = REPO_ROOT / "launcher" / "runtime" / "doctor_rank.py"
DOCTOR_FILE = "doctor.json"  # the judged report, in the run dir
# the doctor's checks each take seconds: a rank silent for this long is stuck (NCCL, gloo)
HANG_TIMEOUT_S = 60.0
STARTUP_TIMEOUT_S = 300.0  # imports, CUDA context, rendezvous (a SLURM node starting cold)


@dataclass(frozen=True, kw_only=True)
class DoctorRequest:
    """One doctor run, as the CLI resolved it."""

    device: str
    ranks_per_node: int
    nodes: int = 1
    precision: str = "auto"  # auto: the rank picks (bf16 on GPUs of capability >= 8, else fp32)
    threshold: float = DEFAULT_THRESHOLD
    topology: str | None = None  # a topology file or name to judge against
    placement: Placement | None = None  # where the backend placed the ranks; None: this host

    @property
    def here(self) -> bool:
        """The ranks run on this host (its detection describes them)."""
        return self.placement is None or self.placement.here

    def __post_init__(self) -> None:
        if not 0 < self.threshold <= 1:
            raise UsageError(f"--threshold must be a fraction in (0, 1], got {self.threshold:g}")
        if self.device == "cpu" and self.precision == "fp16":
            raise UsageError("--precision fp16: CPU ranks time fp32 or bf16 GEMMs; use one of those")


@dataclass(frozen=True, kw_only=True)
class Basis:
    """The topology the ranks are judged against (None: only against each other), and what it is."""

    topology: Topology | None
    text: str


def doctor_spec(request: DoctorRequest, *, run_id: str, run_dir: str | None) -> LaunchSpec:
    """The LaunchSpec that starts the doctor's ranks: the rank script, one rank per device, in
    `run_dir` made absolute (default runs/<run_id>)."""
    path = Path(run_dir if run_dir is not None else Path("runs") / run_id).expanduser().absolute()
    return LaunchSpec(workload=str(DOCTOR_RANK), is_script=True, run_id=run_id, run_dir=str(path),
                      workload_args=("--device", request.device, "--precision", request.precision),
                      device=request.device, nodes=request.nodes, gpus=request.ranks_per_node, warmup_steps=0,
                      hang_timeout_s=HANG_TIMEOUT_S, startup_timeout_s=STARTUP_TIMEOUT_S, compile_mode="default",
                      **RunSettings().decided())


def _probe_text(topology: Topology) -> str:
    dev = topology.accelerator
    if not isinstance(dev, ProbedCpu):
        return f"this machine as detected ({topology.source}) and datasheet figures"
    rates = dev.rates
    gloo = " and its gloo probe" if gloo_of(topology) is not None else ""
    return (f"the CPU probe of this host ({rates.cpu_model}, {rates.cores} cores, torch {torch_version()}, "
            f"measured {rates.measured_at.replace('T', ' ')}){gloo}")


def topology_file(request: DoctorRequest) -> Topology | None:
    """--topology's file, checked against the ranks' device; None when not given."""
    if request.topology is None:
        return None
    topo = load_topology(request.topology)
    if topo.device != request.device:
        where = "this host runs" if request.here else "the SLURM partition's nodes run"
        raise UsageError(f"--topology {request.topology} describes {topo.device} devices, but "
                         f"{where} {request.device} ranks; give a {request.device} topology")
    return topo


def expectation_topology(request: DoctorRequest) -> Basis:
    """What the ranks should measure is read from: --topology's file as listed; else this host
    (detected GPUs, or the CPU with its cached probes, as the planner sees it); under SLURM
    without --topology nothing (the login node is not the compute nodes)."""
    if (topo := topology_file(request)) is not None:
        return Basis(topology=topo, text=f"topology {topo.name} (its listed figures)")
    if not request.here:
        return Basis(topology=None, text="nothing: no --topology of the partition's nodes, so ranks "
                                         "and nodes are judged against each other only")
    topo = resolve_topology(topology=None, gpus=request.ranks_per_node, nodes=None)
    return Basis(topology=topo, text=_probe_text(topo))


def expectations(basis: Basis, readings: list[RankReading], request: DoctorRequest) -> Expectations:
    """The expectation of every check, sized as the ranks measured (bytes, threads, precision)."""
    first = next((r for r in readings if not r.error), None)
    if basis.topology is None or first is None:
        return no_expectations(basis.text)
    if basis.topology.device == "cuda":
        return gpu_expectations(basis.topology, precision=first.precision, nodes=request.nodes, basis=basis.text)
    return cpu_expectations(basis.topology, precision=first.precision, ranks_per_node=request.ranks_per_node,
                            nodes=request.nodes, threads=first.threads, copy_bytes=first.copy_bytes,
                            allreduce_bytes=first.allreduce_bytes, basis=basis.text)


def run_doctor(request: DoctorRequest, basis: Basis, backend: Backend, *, run_id: str,
               run_dir: str | None, console: IO[str] = sys.stderr, debug: bool = False) -> DoctorReport:
    """Start the ranks on `backend`, wait, judge them against `basis` (`expectation_topology`,
    resolved first so that a bad --topology is refused before anything runs); RUN_DIR/doctor.json."""
    started = time.monotonic()
    spec = doctor_spec(request, run_id=run_id, run_dir=run_dir)
    path = Path(spec.run_dir)
    rendered = backend.render(spec, request.placement or Placement(device=request.device))
    create_run_dir(run_dir, run_id)
    # the run's own summary table is not the doctor's: only the ranks' lines reach the console
    result = launch(rendered, backend, console, out=io.StringIO(), debug=debug, quiet=True)
    if result is not None and result.status == "interrupted":
        raise KeyboardInterrupt
    readings = read_readings(path, spec.world_size)
    report = judge(readings, expectations(basis, readings, request), threshold=request.threshold,
                   slurm=not request.here, run_dir=str(path), wall_s=time.monotonic() - started)
    atomic_write_json(path / DOCTOR_FILE, report.to_dict())
    return report


__all__ = ["DoctorRequest", "Basis", "doctor_spec", "topology_file", "expectation_topology", "expectations",
           "run_doctor", "DOCTOR_RANK", "DOCTOR_FILE"]

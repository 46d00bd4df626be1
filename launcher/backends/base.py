"""The one door to every place ranks run: the `Backend` protocol and what it hands back.

Modelled on TorchX's schedulers (`submit = dryrun + schedule`) and submitit's executors:

    backend = select(registry, slurm=...)           # the one place that picks a backend
    placement = backend.place(ask)                   # where the ranks run: devices, nodes, ...
    rendered = backend.render(spec, placement)       # starts nothing; `rendered.dry_run_text`
    ended = backend.start(rendered, ...).follow(c)   # local: torchrun here; SLURM: sbatch, poll

`Ended` says only how the launch ended; the driver (`launcher.drivers.launch`) owns the rest:
launch.json, restarts, the summaries of ranks that died, aggregation, result.json and the
summary. A run that exists (a run dir, a SLURM job id) has `status`, `logs` and `cancel`, from
the first backend in the registry that claims it (`owner_of`): a third backend (a Kubernetes
JobSet, say) is one more entry in `launcher.backends.registry`. Never imports results, report,
drivers, cli or runtime.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import IO, Any, Protocol

from launcher.backends.monitor import Beat, Stall
from launcher.backends.progress import ProgressSpec
from launcher.backends.stacks import StackInfo
from launcher.errors import UsageError
from launcher.runspec import LaunchSpec
from launcher.specs import SlurmSpec

CPU_RANKS = 2  # ranks per node when none were asked for and there is no GPU: the fewest to compare


class State(enum.Enum):
    """Where a run stands, whatever ran it."""

    PENDING = "PENDING"  # accepted, not started (a SLURM job in the queue)
    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"  # over, every rank ok
    FAILED = "FAILED"  # over, not ok
    CANCELLED = "CANCELLED"  # stopped on purpose (dlaunch cancel, Ctrl-C, scancel)
    ORPHANED = "ORPHANED"  # its launcher died and left no result (the report's "orphaned")
    UNKNOWN = "UNKNOWN"  # cannot be told from here (another host's run, a state SLURM has not)

    @property
    def final(self) -> bool:
        """True once the run will not change any more."""
        return self in (State.COMPLETED, State.FAILED, State.CANCELLED, State.ORPHANED)


@dataclass(frozen=True, kw_only=True)
class Evidence:
    """What the launcher saw of the ranks as they ended, for `postmortem.write_missing_summaries`."""

    beats: Mapping[int, Beat] = field(default_factory=dict)  # the last heartbeats seen
    stacks: Mapping[int, StackInfo] = field(default_factory=dict)  # of hung ranks
    torchrun_log: str = ""  # what torchrun said during the attempt


@dataclass(frozen=True, kw_only=True)
class Ended:
    """How one launch ended, as its backend saw it; the rank files say the rest."""

    exit_code: int = 0  # torchrun's (128 + signal), HANG_EXIT_CODE, or the SLURM job's
    interrupted: int | None = None  # the signal (SIGINT, SIGTERM) the user stopped dlaunch with
    stall: Stall | None = None  # why the launcher ended the job, if it did
    warnings: tuple[str, ...] = ()  # drift from the plan, processes the job left running
    failure: str | None = None  # the backend's own failure line ("SLURM job 8 ended FAILED")
    restartable: bool = False  # a failed attempt may be relaunched in place (--max-restarts)
    detached: str | None = None  # the job's reference, when dlaunch left it running (--detach)
    after: str = ""  # a line to print after the summary (SLURM's timings)
    wall_time_s: float | None = None  # from submission (SLURM); None: the driver's own clock
    evidence: Evidence | None = None  # None: the nodes wrote their ranks' summaries themselves


@dataclass(frozen=True, kw_only=True)
class JobStatus:
    """What `status` says of one run: `text` (first lines), `progress` (shown while there is no
    result) and `data` (--json), in the backend's words; the driver adds the summary once it is over."""

    state: State
    reason: str = ""  # why it is in this state, in words ('' when nothing to add)
    backend_state: str = ""  # the backend's own word for it (SLURM's JobState)
    run_dir: str | None = None
    steps: Mapping[int, int] = field(default_factory=dict)  # rank -> last step it reported
    total_steps: int | None = None
    text: str = ""
    progress: str = ""
    data: Mapping[str, Any] = field(default_factory=dict)
    ended: Ended | None = None  # a run over without result.json yet (a detached job): how it ended


@dataclass(frozen=True, kw_only=True)
class Cancelled:
    """What `cancel` did."""

    before: State
    after: State
    message: str  # one or more lines for the user


class SlurmAsk(Protocol):
    """The SLURM flags of a command (the CLI's options, read by attribute), for SLURM's `place`."""

    @property
    def gpus_per_node(self) -> int | None: ...
    @property
    def partition(self) -> str | None: ...
    @property
    def account(self) -> str | None: ...
    @property
    def qos(self) -> str | None: ...
    @property
    def constraint(self) -> str | None: ...
    @property
    def time_min(self) -> float: ...
    @property
    def cpus_per_node(self) -> int | None: ...
    @property
    def slurm_opt(self) -> tuple[tuple[str, str], ...]: ...
    @property
    def queue_timeout_min(self) -> float | None: ...


@dataclass(frozen=True, kw_only=True)
class Ask:
    """Where a command's ranks were asked to run, before a backend places them."""

    command: str  # run | lab | scale | tune | doctor
    gpus: int | None = None  # processes per node; None: one per device of the nodes (doctor)
    nodes: int | None = None
    sizes: str | None = None  # scale: its world sizes, "1,2,4"
    topology: str | None = None  # a topology file of the nodes the ranks run on
    force: bool = False  # more CPU processes than `per_core` per core
    per_core: int = 4  # CPU processes per usable core beyond which a run measures contention
    dry_run: bool = False
    detach: bool = False
    slurm: SlurmAsk | None = None  # the SLURM flags (with --slurm)


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where a request's ranks run, as placed; for a sweep, its largest point (the plan's) and every point's shape."""

    device: str
    nodes: int = 1
    gpus: int = 1  # processes per node
    here: bool = True  # the ranks run on this host: detecting it describes them
    where: str = "this host"  # in words
    notice: str = ""  # a line to show before the ranks start (CPU processes instead of GPUs)
    slurm: SlurmSpec | None = None  # the job's SLURM side
    topology: str | None = None  # a topology file of the nodes, for the plan
    shapes: tuple[tuple[int, int, int], ...] = ()  # scale: (world size, nodes, processes per node)
    per_node: int | None = None  # scale: processes per node of a multi-node point (None: one host)


class Rendered(Protocol):
    """A rendered run: everything needed to start it, nothing started."""

    @property
    def spec(self) -> LaunchSpec: ...

    @property
    def dry_run_text(self) -> str:
        """What `--dry-run` prints for it."""


class Handle(Protocol):
    """A started run."""

    def follow(self, console: IO[str]) -> Ended:
        """Wait for the run's end, showing its progress on `console`; how it ended."""


class Backend(Protocol):
    """A place where ranks run; see the module docstring."""

    name: str

    def claims(self, ref: str) -> bool:
        """Whether `ref` (typed after status/logs/cancel) is this backend's run; from files only."""

    def place(self, ask: Ask) -> Placement:
        """Where the ranks go (raises on what cannot run there: bad flags fail here)."""

    def render(self, spec: LaunchSpec, placement: Placement) -> Rendered:
        """The run, rendered (nothing starts; raises on what cannot run here)."""

    def start(self, rendered: Rendered, *, attempt: int = 0, debug: bool = False,
              note: str | None = None, progress: ProgressSpec | None = None) -> Handle:
        """Start (or submit) attempt `attempt`; `note` (the plan's) is printed once the run is accepted
        (a refusal stays one error line); `progress`: the live progress line's measure (None: none)."""

    def status(self, ref: str) -> JobStatus:
        """Where the run stands now."""

    def logs(self, ref: str, *, out: IO[str], rank: int | None = None, follow: bool = False) -> None:
        """Print the ranks' output (one rank's with `rank`); `follow` until the run is over."""

    def cancel(self, ref: str) -> Cancelled:
        """Stop the run if it runs, waiting briefly for it to stop; say what was done."""


Registry = Mapping[str, Backend]
"""name -> backend. The CLI's table is launcher.backends.registry.BACKENDS: local and slurm."""


def select(registry: Registry, *, slurm: bool, name: str | None = None) -> Backend:
    """The backend a new run goes to: `name` when given, else slurm for `--slurm`, else local."""
    chosen = name or ("slurm" if slurm else "local")
    try:
        return registry[chosen]
    except KeyError:
        raise UsageError(f"no backend {chosen!r}; known: {', '.join(sorted(registry))}") from None


def owner_of(registry: Registry, ref: str) -> Backend:
    """The backend whose run `ref` is: the first in the registry that claims it."""
    for backend in registry.values():
        if backend.claims(ref):
            return backend
    raise UsageError(f"{ref!r} is neither a run directory nor a SLURM job id")


def parse_world_sizes(text: str, *, available: int | None = None, flag: str = "--gpus",
                      what: str = "devices") -> list[int]:
    """`"1,2,4"` -> `[1, 2, 4]` (sorted); a one-line UsageError for a bad item or one above `available`."""
    if not str(text).strip():
        raise UsageError(f"{flag} needs a comma-separated list of world sizes, e.g. {flag} 1,2,4")
    sizes: list[int] = []
    for i, item in enumerate(str(text).split(","), 1):
        item = item.strip()
        if not item:
            raise UsageError(f"{flag} {text!r}: item {i} is empty; give world sizes like 1,2,4")
        try:
            n = int(item)
        except ValueError:
            raise UsageError(f"{flag} {text!r}: {item!r} is not an integer; give world sizes like 1,2,4") from None
        if n < 1:
            raise UsageError(f"{flag} {text!r}: world sizes must be >= 1, got {n}")
        if n in sizes:
            raise UsageError(f"{flag} {text!r}: world size {n} is listed twice; use --repeat R "
                             "to run a point several times")
        sizes.append(n)
    if available is not None and max(sizes) > available:
        raise UsageError(f"{flag} {text!r}: world size {max(sizes)} is more than the {available} "
                         f"{what} available here; drop it, or sweep where more are available")
    return sorted(sizes)


def point_shapes(sizes: list[int], per_node: int | None) -> tuple[tuple[int, int, int], ...]:
    """(world size, nodes, processes per node) of each point: one node while it fits, else whole
    nodes of `per_node` (None: one host); a UsageError for a size beyond one node not a multiple."""
    out = []
    for n in sizes:
        if per_node is None or n <= per_node:
            out.append((n, 1, n))
            continue
        if n % per_node:
            raise UsageError(f"world size {n} does not fill whole nodes of {per_node} processes; "
                             f"above one node use multiples of {per_node} (or set --gpus-per-node)")
        out.append((n, n // per_node, per_node))
    return tuple(out)

"""The one door to every place ranks run: the `Backend` protocol and what it hands back.

Modelled on TorchX's schedulers (`submit = dryrun + schedule`) and submitit's executors:

    backend = select(registry, slurm=...)         # the one place that picks a backend
    rendered = backend.render(spec, request)       # starts nothing; `rendered.dry_run_text`
    handle = backend.start(rendered, ...)          # local: nothing yet; SLURM: sbatch
    result = handle.follow(out)                    # to the end: the RunResult (None: detached)

and, for a run that exists (a run dir, or a SLURM job id), `status`, `logs` and `cancel`.
Which backend a run dir belongs to is asked of each backend in the registry in turn
(`owner_of`): a third backend (a Kubernetes JobSet, say) is one more entry in the registry.

The implementations live where the code they wrap may be imported: `launcher.jobs.local`
(`LocalBackend`) and `launcher.jobs.slurm` (`SlurmBackend`), since following a run to its
result aggregates the rank files (launcher.results). This module imports neither: only types,
and the request and result types only for the type checker.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any, Protocol

from launcher.errors import UsageError
from launcher.specs import LaunchSpec

if TYPE_CHECKING:  # types only: a backend never needs the request or results code to be typed
    from launcher.request import RunRequest
    from launcher.results.types import RunResult


class State(enum.Enum):
    """Where a run stands, whatever ran it."""

    PENDING = "PENDING"  # accepted, not started (a SLURM job in the queue)
    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"  # over, every rank ok
    FAILED = "FAILED"  # over, not ok
    CANCELLED = "CANCELLED"  # stopped on purpose (dlaunch cancel, Ctrl-C, scancel)
    GONE = "GONE"  # its launcher died and left no result
    UNKNOWN = "UNKNOWN"  # cannot be told from here (another host's run, a state SLURM has not)

    @property
    def final(self) -> bool:
        """True once the run will not change any more."""
        return self in (State.COMPLETED, State.FAILED, State.CANCELLED, State.GONE)


@dataclass(frozen=True, kw_only=True)
class JobStatus:
    """What `status` says about one run: the state, why, and how far the ranks got.

    `text` and `data` are what `dlaunch status` prints (and prints with --json): each backend
    words its own (SLURM's queue line, a local run's owner), the CLI only prints them.
    """

    state: State
    reason: str = ""  # why it is in this state, in words ('' when nothing to add)
    backend_state: str = ""  # the backend's own word for it (SLURM's JobState)
    run_dir: str | None = None
    steps: Mapping[int, int] = field(default_factory=dict)  # rank -> last step it reported
    total_steps: int | None = None
    text: str = ""
    data: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Cancelled:
    """What `cancel` did."""

    before: State
    after: State
    message: str  # one or more lines for the user


class Rendered(Protocol):
    """A rendered run: everything needed to start it, nothing started."""

    @property
    def spec(self) -> LaunchSpec: ...

    @property
    def dry_run_text(self) -> str:
        """What `dlaunch run --dry-run` prints for it."""
        ...


class Handle(Protocol):
    """A started run."""

    def follow(self, out: IO[str]) -> RunResult | None:
        """Wait for the run's end, showing its progress and then its summary on `out`; the
        aggregated result (None: nothing to wait for, a detached SLURM job)."""
        ...


class Backend(Protocol):
    """A place where ranks run; see the module docstring."""

    name: str

    def claims(self, ref: str) -> bool:
        """True when `ref` (what the user typed after status/logs/cancel) is one of this
        backend's runs; checks files only, asks no scheduler."""
        ...

    def render(self, spec: LaunchSpec, request: RunRequest) -> Rendered:
        """The run, rendered (nothing starts; raises on what cannot run here)."""
        ...

    def start(self, rendered: Rendered, *, as_json: bool = False, debug: bool = False,
              note: str | None = None, quiet: bool = False) -> Handle:
        """Start (or submit) the run. `note` (the plan's) is printed once the run is accepted,
        so a refusal stays a single error line. `quiet`: no live progress line."""
        ...

    def status(self, ref: str) -> JobStatus:
        """Where the run stands now."""
        ...

    def logs(self, ref: str, *, out: IO[str], rank: int | None = None,
             follow: bool = False) -> None:
        """Print the ranks' output (one rank's with `rank`); `follow` until the run is over."""
        ...

    def cancel(self, ref: str) -> Cancelled:
        """Stop the run if it runs, waiting briefly for it to stop; say what was done."""
        ...


Registry = Mapping[str, Backend]
"""name -> backend. The CLI's table (launcher.cli.jobs.BACKENDS) holds local and slurm."""


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

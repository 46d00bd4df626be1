"""`LocalBackend`: the Backend of this host (launcher.backends.base). It places ranks on this
host's GPUs (else CPU processes), renders the torchrun command with its dry run, starts and
follows one attempt at a time (`launcher.backends.local`), and reads a local run dir's status,
logs and cancel (`launcher.backends.localrun`). Never imports results, report, drivers, cli or runtime.
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from launcher.backends import local, localrun
from launcher.backends.base import (
    CPU_RANKS,
    Ask,
    Cancelled,
    Ended,
    JobStatus,
    Placement,
    Rendered,
    parse_world_sizes,
    point_shapes,
)
from launcher.backends.progress import ProgressSpec
from launcher.errors import UsageError
from launcher.hardware.detect import usable_cores
from launcher.hardware.gpu_probe import count_gpus
from launcher.rundir import RunPaths
from launcher.runspec import LaunchSpec
from launcher.secrets import mask_env, masked_spec_dict

NO_GPU = "no CUDA GPU on this machine"


@dataclass(frozen=True, kw_only=True)
class LocalRendered:
    """A local run rendered: its spec and the torchrun command."""

    spec: LaunchSpec
    command: local.Rendered

    @property
    def dry_run_text(self) -> str:
        """The command, the environment dlaunch adds (secrets masked: launcher.secrets) and the spec."""
        spec, env = self.spec, "\n".join(f"  {k}={v}" for k, v in sorted(mask_env(self.command.env).items()))
        restarts = (f"# up to {spec.max_restarts} restart(s); each adds DLAUNCH_ATTEMPT=<n> "
                    "DLAUNCH_RESUME=1\n" if spec.max_restarts else "")
        return (f"# command\n{shlex.join(self.command.argv)}\n# environment added for the ranks\n{env}\n"
                f"{restarts}# launch spec ({RunPaths(root=spec.run_dir).launch})\n"
                f"{json.dumps(masked_spec_dict(spec), indent=2)}\n")


@dataclass(frozen=True, kw_only=True)
class LocalHandle:
    """One attempt of a local run about to run: `follow` runs it (dlaunch is its owner)."""

    rendered: LocalRendered
    attempt: int = 0
    debug: bool = False
    progress: ProgressSpec | None = None

    def follow(self, console: IO[str]) -> Ended:
        """Run torchrun to the end; a relaunch sees DLAUNCH_ATTEMPT=<n> and DLAUNCH_RESUME=1."""
        extra = {"DLAUNCH_ATTEMPT": str(self.attempt), "DLAUNCH_RESUME": "1"} if self.attempt else {}
        return local.launch(self.rendered.command, self.rendered.spec, console=console, debug=self.debug,
                            extra_env=extra, attempt=self.attempt, progress=self.progress)


class LocalBackend:
    """torchrun on this host; a run is its run dir (owner.json names the dlaunch running it)."""

    name = "local"

    def claims(self, ref: str) -> bool:
        """Any directory: the SLURM backend, asked first, claims those with slurm.json."""
        return Path(ref).expanduser().is_dir()

    def place(self, ask: Ask) -> Placement:
        """This host: its GPUs, else CPU processes (more than `ask.per_core` per usable core
        only with `ask.force`); a sweep's every world size, if this host holds them."""
        if ask.sizes is not None:
            gpus, cores = count_gpus(), usable_cores()
            sizes = parse_world_sizes(ask.sizes, available=gpus or ask.per_core * cores, what="GPUs" if gpus
                                      else f"CPU processes ({ask.per_core} per usable core, {cores} cores)")
            return Placement(device="cuda" if gpus else "cpu", gpus=max(sizes), shapes=point_shapes(sizes, None))
        found = count_gpus()
        n = ask.gpus or found or CPU_RANKS  # no --gpus: one rank per device (doctor)
        if 0 < found < n:
            raise UsageError(f"--gpus {n} asked for more GPUs than this machine has ({found}); "
                             f"use --gpus {found} or fewer, or --slurm for more nodes")
        device = "cuda" if found else "cpu"
        if device == "cpu" and not ask.force:
            cores = usable_cores()
            if n > ask.per_core * cores:
                raise UsageError(f"--gpus {n}: no GPU here, and {n} CPU processes on {cores} usable core(s) "
                                 f"would measure contention (at most {ask.per_core * cores}); use fewer, or --force")
        return Placement(device=device, gpus=n, notice=NO_GPU if device == "cpu" else "")

    def render(self, spec: LaunchSpec, placement: Placement | None = None) -> LocalRendered:
        """The torchrun command for `spec` (this host needs nothing more of the placement)."""
        return LocalRendered(spec=spec, command=local.render(spec))

    def start(self, rendered: Rendered, *, attempt: int = 0, debug: bool = False,
              note: str | None = None, progress: ProgressSpec | None = None) -> LocalHandle:
        """Nothing to submit: the attempt starts, in this process, when it is followed."""
        if not isinstance(rendered, LocalRendered):
            raise TypeError(f"the local backend cannot start {type(rendered).__name__}")
        if note and not attempt:
            print(note, file=sys.stderr)
        return LocalHandle(rendered=rendered, attempt=attempt, debug=debug, progress=progress)

    def status(self, ref: str) -> JobStatus:
        """From the run dir's files: see launcher.backends.localrun."""
        st = localrun.read_state(localrun.run_dir_of(ref))
        data = {"run_dir": str(st.run_dir), "state": st.state.value, "reason": st.reason, "pid": st.pid,
                "host": st.host, "steps": {str(r): s for r, s in st.steps.items()}, "total_steps": st.total_steps,
                "last_heartbeat_s": st.beat_age_s, "step_s": st.step_s, "result": None}
        return JobStatus(state=st.state, reason=st.reason, run_dir=str(st.run_dir), steps=st.steps,
                         total_steps=st.total_steps, progress=localrun.progress_line(st), data=data,
                         text=f"run {st.run_dir}: {st.state.value}" + (f" ({st.reason})" if st.reason else ""))

    def logs(self, ref: str, *, out: IO[str], rank: int | None = None, follow: bool = False) -> None:
        """torchrun's per-rank log files (logs/node-0/...)."""
        localrun.logs(localrun.run_dir_of(ref), out=out, rank=rank, follow=follow)

    def cancel(self, ref: str) -> Cancelled:
        """SIGTERM to the owning dlaunch, which stops the job and writes its result."""
        return localrun.cancel(localrun.run_dir_of(ref))

"""The program torchrun starts in every rank: `python -m launcher.runtime.entry LAUNCH_JSON`.

It reads the launch spec the launcher wrote, builds the workload, trains it under the harness,
and always leaves a summary file saying how the rank ended (ok, preempted — a checkpoint was
saved on the preemption signal, exit 0 — failed or stopped). A failure is reported as one line
on stderr (the traceback goes to the summary file; `DLAUNCH_DEBUG=1` prints it).

This is the rank's door (see runtime/__init__): the recorder is created first, from torch-free
modules, and only then are torch and the training machinery imported, inside the recorded
part, so a slow, hung or broken torch import is one the heartbeat and the summary see.

Never imports cli, backends, jobs or report, and no torch before the recorder exists.
"""

from __future__ import annotations

import atexit
import gc
import json
import logging
import os
import signal
import sys
import traceback
from types import FrameType

from launcher.runspec import LaunchSpec
from launcher.runtime.context import from_env, init_distributed, shutdown_distributed, watch_parent
from launcher.runtime.preemption import stop_requested
from launcher.runtime.recorder import RankRecorder, error_line
from launcher.workload import load_workload


class Stopped(SystemExit):
    """SIGTERM: torchrun (another rank failed) or dlaunch (a hang, Ctrl-C) is ending the job."""

    def __str__(self) -> str:
        return "stopped by SIGTERM while the job was being ended"


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    # torchrun stops the surviving ranks with SIGTERM when one fails: unwind so the
    # recorder flushes what this rank measured and writes its summary. Only once: torchrun and
    # dlaunch may both send one, and a second raise would cut that summary short
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # the stop reaches the DataLoader's workers too; torch's SIGCHLD handler would raise for
    # each at exit, a traceback that buries why the job ended
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    raise Stopped(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """Run one rank; returns the process exit code."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m launcher.runtime.entry LAUNCH_JSON", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _on_sigterm)
    # no cyclic GC until the first step (the harness freezes what setup made, then enables it):
    # importing torch and building the model make ~300k objects that every full collection
    # rescans: 5 collections, 0.3 s of a 2-rank CPU run's 3.7 s to its first step, measured
    gc.disable()
    watch_parent()
    logging.basicConfig(level=logging.DEBUG if os.environ.get("DLAUNCH_DEBUG") else logging.WARNING)

    with open(args[0], encoding="utf-8") as f:
        spec = LaunchSpec.from_dict(json.load(f))

    ctx = from_env(spec.device)
    recorder = RankRecorder(spec.run_dir, ctx.rank, {
        "run_id": spec.run_id, "local_rank": ctx.local_rank, "node_rank": ctx.node_rank, "world_size": ctx.world_size,
        "host": ctx.host, "device": spec.device, "strategy": spec.strategy, "precision": spec.precision,
        "micro_batch": spec.micro_batch, "grad_accum": spec.grad_accum}, dump_stacks=True)
    try:
        # deferred, the one place: torch (1-2 s) and the training machinery load only now that
        # the recorder beats and can say how the rank ended (see runtime/__init__)
        from launcher.runtime import harness, wrap

        workload = load_workload(spec.workload, spec.workload_args)
        recorder.add({"kind": "workload", "sample_units": workload.sample_units,
                      "units_per_sample": workload.units_per_sample})
        # a hung collective must end long before gloo/NCCL's 30-minute default; FSDP's mesh
        # needs the group on one rank too
        init_distributed(ctx, timeout_s=spec.collective_timeout_s, mesh=wrap.uses_device_mesh(spec.parallel))
        outcome = harness.train(workload, spec, ctx, recorder)
        # `preempted` also exits 0: the checkpoint is saved, a requeue or restart resumes it
        recorder.finish(outcome.status, extra=outcome.summary or None)
        return 0
    except BaseException as e:  # noqa: BLE001 - every way out must leave a summary
        # a stop now (torchrun's, after the peer this rank lost failed) must not cut the summary short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # a rank told to stop (SIGTERM under SLURM) whose next collective then failed (a peer
        # was already gone) was being stopped, not failing of its own
        status = "stopped" if isinstance(e, Stopped) or stop_requested() is not None else "failed"
        recorder.finish(status, error=e)
        if os.environ.get("DLAUNCH_DEBUG"):
            traceback.print_exc()
        else:
            print(f"rank {ctx.rank} {status}: {error_line(e)}", file=sys.stderr)
        return 1 if not isinstance(e, SystemExit) else int(e.code or 1)
    finally:
        # the summary is written: a SIGTERM from now on (torchrun stopping the job) need not
        # unwind anything, and raising it inside an atexit hook would only print a traceback
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        shutdown_distributed()


def exit_now(code: int) -> None:
    """End the rank with `code`: stdio and logging flushed, the atexit hooks run (a workload's
    own), but not the interpreter's teardown, which frees torch and Dynamo module by module (0.9 s
    on a 2-core host) and at times aborted ("terminate called without an active exception")."""
    try:
        atexit._run_exitfuncs()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


if __name__ == "__main__":
    exit_now(main())

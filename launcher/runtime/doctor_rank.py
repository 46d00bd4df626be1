"""The program every rank of `dlaunch doctor` runs: time a GEMM, a large copy and all-reduces
(runtime.doctor_checks says how each is measured).

torchrun starts it as a plain script (`python -u .../doctor_rank.py --device D --precision P`),
so the local and the SLURM backends launch it exactly as they launch a run. The rank writes
through the run's `RankRecorder`: its heartbeat names the phase it is in (`doctor_checks.PHASES`),
so the launcher's hang watcher can end a stuck doctor and name the rank; its summary carries
what it measured under `doctor`, which launcher.results.doctor reads. Every number here is
measured; what it should have been is the launcher's business (launcher.plan.expected).

Like runtime.entry this is a rank's door (see runtime/__init__): the recorder first, then torch
and the checks, after the script's own folder has left `sys.path` (see the end of this file).
Never imports cli, backends, jobs or report.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from launcher.runtime.context import from_env, shutdown_distributed, watch_parent
from launcher.runtime.recorder import RankRecorder


def main(argv: list[str] | None = None) -> int:
    """Run one doctor rank; returns its exit code."""
    parser = argparse.ArgumentParser(prog="doctor_rank")
    parser.add_argument("--device", choices=("cuda", "cpu"), required=True)
    parser.add_argument("--precision", choices=("auto", "fp32", "bf16", "fp16"), default="auto")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    watch_parent()
    logging.basicConfig(level=logging.DEBUG if os.environ.get("DLAUNCH_DEBUG") else logging.WARNING)
    ctx = from_env(args.device)
    run_dir = os.environ.get("DLAUNCH_RUN_DIR") or "."
    recorder = RankRecorder(run_dir, ctx.rank, {
        "local_rank": ctx.local_rank, "node_rank": ctx.node_rank, "world_size": ctx.world_size,
        "host": ctx.host, "device": args.device, "doctor": True}, dump_stacks=True)
    try:
        # deferred, the one place: torch loads only now that the recorder beats and can say how
        # the rank ended (see runtime/__init__)
        from launcher.runtime.doctor_checks import measure

        result = measure(ctx, recorder, args.precision)
        recorder.add({"kind": "doctor", **result})
        recorder.finish("ok", extra={"doctor": result})
        return 0
    except BaseException as e:  # noqa: BLE001 - every way out leaves a summary saying why
        recorder.finish("failed", error=e)
        print(f"rank {ctx.rank} failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    # run as a script: its own folder (launcher/runtime) would otherwise come first on sys.path
    # and its modules (context, profiling, checkpoint...) could shadow top-level ones
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    from launcher.runtime.entry import exit_now  # flushes, then skips the interpreter's teardown

    exit_now(main())

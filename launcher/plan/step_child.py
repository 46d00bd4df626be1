"""The step probe in a child process: workload code never runs in dlaunch's own process to time it.

`step_probe.measure_steps` trains the workload for a few steps; its code may sleep, exit, crash the
interpreter or flood a stream. Run here (`python -m launcher.plan.step_child REQUEST RESULT`), the
probe has its own process group, a time limit, its output in a file of its own (the last lines kept
for the error), and its result in a JSON file: `probe_in_child` returns the timing or raises
`StepProbeFailed` with one line saying why (the planner then plans without it). A fresh process
also times the steps as a rank sees them, with no planner's objects around them.

Never imports cli, backends, jobs, runtime, results or report; torch only in the child.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from launcher.errors import PlanError
from launcher.files import atomic_write_json
from launcher.plan.step_probe import WorkloadTiming, as_cached, measure_steps

# the probe's own budget is seconds (step_probe.BUDGET_S); importing torch and building the model
# in a fresh process takes a few more on a loaded 2-core host
STEP_PROBE_TIMEOUT_S = 120.0
TIMEOUT_ENV = "DLAUNCH_STEP_PROBE_TIMEOUT_S"  # a shorter limit, for tests of hanging workloads
_TAIL_BYTES = 2000
# seconds the probe's child has to end on SIGTERM when dlaunch is stopped: a workload's step
# does not take longer to notice it (Python's default action is to exit at once)
END_GRACE_S = 2.0


class StepProbeFailed(PlanError):
    """The workload's steps could not be timed (it raised, exited, hung or crashed)."""


def _last_line(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - _TAIL_BYTES))
            tail = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def _end(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """End the probe's process group if its leader still runs: SIGTERM, then SIGKILL after `grace_s` (0: at once)."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):  # the whole group has ended
        if grace_s > 0:
            os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace_s)
        os.killpg(proc.pid, signal.SIGKILL)  # the leader, or what the workload started in the group
    proc.wait()


def probe_in_child(workload: str, workload_args: Sequence[str], *, threads: int, precisions: Sequence[str],
                   micro_batches: Sequence[int], timeout_s: float | None = None) -> WorkloadTiming:
    """`measure_steps` of the workload in a child process (see the module docstring)."""
    if timeout_s is None:
        timeout_s = float(os.environ.get(TIMEOUT_ENV) or STEP_PROBE_TIMEOUT_S)
    with tempfile.TemporaryDirectory(prefix="dlaunch-step-probe-") as tmp:
        request, result, output = Path(tmp, "request.json"), Path(tmp, "result.json"), Path(tmp, "output.log")
        atomic_write_json(request, {"workload": str(workload), "args": list(workload_args),
                                    "threads": threads, "precisions": list(precisions),
                                    "micro_batches": list(micro_batches)})
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
        with open(output, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "launcher.plan.step_child", str(request),
                                     str(result)], stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                code = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _end(proc, grace_s=0)
                raise StepProbeFailed(f"the workload's steps did not finish in {timeout_s:.0f} s "
                                      "(a hang, or a step far slower than planned)") from None
            finally:
                # interrupted while waiting (Ctrl-C, SIGTERM: cli.main): take the child along before its temp dir goes
                _end(proc, grace_s=END_GRACE_S)
        if code != 0 or not result.is_file():
            what = (f"exited with code {code}" if code > 0 else
                    f"was killed by {signal.Signals(-code).name}" if code < 0 else
                    "exited before its steps were timed (sys.exit in the workload?)")
            raise StepProbeFailed(f"the workload's step probe {what}: {_last_line(output) or 'no output'}")
        try:
            return WorkloadTiming.from_dict(json.loads(result.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError, KeyError, PlanError) as e:
            raise StepProbeFailed(f"the step probe's result is unreadable: {e}") from None


def main(argv: Sequence[str]) -> int:
    """The child: load the workload, time its steps, write the timing."""
    from launcher.workload import load_workload

    request = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    timing = measure_steps(load_workload(request["workload"], request["args"]), threads=int(request["threads"]),
                           precisions=request["precisions"], micro_batches=[int(mb) for mb in request["micro_batches"]])
    # the workload may have replaced sys.stdout: the result goes to its own file
    atomic_write_json(argv[1], as_cached(timing))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

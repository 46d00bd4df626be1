"""The one-threaded parent of a local torchrun, so that torchrun hears of dlaunch's death once.

Linux sends a child its parent-death signal (PR_SET_PDEATHSIG) whenever the thread that is its
parent exits, and a child of a process with several threads is handed from each exiting thread
to the next: torchrun started straight from dlaunch (main thread, output follower, heartbeat
watcher, whatever torch left running in planning) got one SIGTERM per thread when dlaunch was
SIGKILLed. torchrun turns each SIGTERM into an exception; a third one that lands inside its own
shutdown abandons it, leaving its ranks running and its log tailers holding it alive.

So dlaunch starts this process instead (`python -m launcher.backends.keeper TORCHRUN_ARGV...`),
with SIGKILL as its death signal, and this process, with one thread, starts torchrun with SIGTERM
as torchrun's: dlaunch's death reaches torchrun exactly once, and torchrun stops its ranks as it
does on any SIGTERM. It waits for torchrun and exits as torchrun did (the same code, or killed
by the same signal). A SIGTERM, SIGINT or SIGHUP it gets (`local.stop_job` ending the job) it
passes on to torchrun, once each, and waits for torchrun's exit; one that comes before torchrun
started means torchrun never starts.

A leaf module (standard library only): it starts before torch is needed anywhere.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence

KEEPER_MODULE = "launcher.backends.keeper"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
# signals that end the job: passed on to torchrun, which stops its ranks; the keeper waits on
_PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def tie_to_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A `preexec_fn` after which the child gets `sig` when the calling thread's process dies
    (once per thread of it that exits: see the module docstring). None where Linux's
    parent-death signal does not exist."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: never after fork
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died between fork and prctl
            os.kill(os.getpid(), sig)

    return preexec


def keeper_argv(python: str, argv: Sequence[str]) -> list[str]:
    """The command that runs `argv` (torchrun's) under a keeper."""
    return [python, "-m", KEEPER_MODULE, *argv]


def main(argv: Sequence[str]) -> int:
    """Run `argv` as this process's only child and return its exit status (negative: a signal)."""
    child: list[subprocess.Popen[bytes]] = []
    pending: list[int] = []  # signals that came before the child existed

    def pass_on(signum: int, _frame: object) -> None:
        if child:
            child[0].send_signal(signum)  # a no-op once it has been waited for
        else:
            pending.append(signum)

    # handlers, not SIG_IGN: exec resets handlers to the default, so torchrun and its ranks
    # start with their usual dispositions
    for sig in _PASSED_ON:
        signal.signal(sig, pass_on)
    if pending:
        return -pending[0]
    child.append(subprocess.Popen(list(argv), preexec_fn=tie_to_parent(signal.SIGTERM)))
    for signum in pending:  # came while it was being started
        child[0].send_signal(signum)
    return child[0].wait()


if __name__ == "__main__":
    code = main(sys.argv[1:])
    if code < 0:  # torchrun was killed: die of the same signal, as dlaunch would have seen it
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)

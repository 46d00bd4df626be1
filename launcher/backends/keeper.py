"""The one-threaded parent of a local torchrun, so that torchrun hears of dlaunch's death once.

Linux sends a child its parent-death signal (PR_SET_PDEATHSIG) whenever the thread that is its
parent exits, and a child of a process with several threads is handed from each exiting thread
to the next: torchrun started straight from dlaunch (main thread, output follower, watcher, what
torch left running) got one SIGTERM per thread when dlaunch was SIGKILLed, and one that lands
inside torchrun's own shutdown abandons it, leaving its ranks running.

So dlaunch starts this process instead (`python -m launcher.backends.keeper TORCHRUN_ARGV...`),
with SIGKILL as its death signal, and this process, with one thread, starts torchrun with SIGTERM
as torchrun's: dlaunch's death reaches torchrun exactly once. It exits as torchrun did (the same
code, or killed by the same signal). A SIGTERM, SIGINT or SIGHUP it gets (`local.stop_job`) it
passes on to torchrun, once each; one that comes before torchrun started means it never starts.

It is also the job's child subreaper: a process a rank started that outlives its rank is handed
to the keeper instead of init, so once torchrun has exited the keeper ends what is left (SIGTERM,
SIGKILL after LEFTOVER_GRACE_S) and says so in one line starting with LEFTOVER_PREFIX. A leaf
module (standard library only): it starts before torch is needed anywhere.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

KEEPER_MODULE = "launcher.backends.keeper"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_PR_SET_CHILD_SUBREAPER = 36
# a leftover is a process torchrun no longer knows of: a short grace, the job has ended already
LEFTOVER_GRACE_S = 3.0
LEFTOVER_PREFIX = "dlaunch: the job left "
# signals that end the job: passed on to torchrun, which stops its ranks; the keeper waits on
_PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _prctl() -> Callable[..., int] | None:
    """libc's prctl, or None where there is none (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def tie_to_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A `preexec_fn` after which the child gets `sig` when the calling thread's process dies
    (once per thread of it that exits: see the module docstring); None off Linux."""
    prctl = _prctl()  # looked up here: never after fork
    if prctl is None:
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


def _children() -> dict[int, str]:
    """This process's living (not zombie) children: pid -> command line, from /proc."""
    me, out = os.getpid(), {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                # the command name is in parentheses and may hold spaces: fields follow the last ')'
                state, ppid = f.read().rsplit(b")", 1)[1].split()[:2]
            if int(ppid) != me or state == b"Z":
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                out[int(entry)] = f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
        except (OSError, ValueError):  # gone meanwhile
            continue
    return out


def _reap() -> None:
    """Collect every child that has exited (the leftovers handed to this subreaper)."""
    with contextlib.suppress(ChildProcessError):  # no child left
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def _signal(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def end_leftovers(grace_s: float = LEFTOVER_GRACE_S) -> dict[int, str]:
    """End the processes handed to this subreaper once torchrun exited: SIGTERM, then SIGKILL
    to any still there after `grace_s`; the ones found (pid -> command line)."""
    found = _children()
    if not found:
        return {}
    _signal(list(found), signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        _reap()
        left = _children()
        found.update(left)  # a leftover's own children come to this subreaper as it dies
        if not left:
            return found
        time.sleep(0.05)
    for _ in range(100):  # SIGKILL until none is left (each may hand on children as it dies)
        left = _children()
        if not left:
            break
        found.update(left)
        _signal(list(left), signal.SIGKILL)
        time.sleep(0.02)
        _reap()
    return found


def _say_leftovers(found: dict[int, str]) -> None:
    """One line on stderr (torchrun's stream, which dlaunch shows) naming what was ended."""
    if not found:
        return
    shown = "; ".join(f"pid {pid}: {' '.join(cmd.split())[:120] or '?'}"
                      for pid, cmd in sorted(found.items())[:5])
    more = f" and {len(found) - 5} more" if len(found) > 5 else ""
    print(f"{LEFTOVER_PREFIX}{len(found)} process(es) running after torchrun exited ({shown}{more}); dlaunch "
          "ended them (SIGTERM, then SIGKILL): a process a rank starts should end with it", file=sys.stderr, flush=True)


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
    prctl = _prctl()
    if prctl is not None:
        prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    child.append(subprocess.Popen(list(argv), preexec_fn=tie_to_parent(signal.SIGTERM)))
    for signum in pending:  # came while it was being started
        child[0].send_signal(signum)
    code = child[0].wait()
    _say_leftovers(end_leftovers())
    return code


if __name__ == "__main__":
    code = main(sys.argv[1:])
    if code < 0:  # torchrun was killed: die of the same signal, as dlaunch would have seen it
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)

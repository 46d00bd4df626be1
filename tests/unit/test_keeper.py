"""backends.keeper: torchrun's one-threaded parent. A parent with many threads that is SIGKILLed
reaches the kept process with exactly one SIGTERM; the keeper passes on a SIGTERM it gets, exits
as its child did, and starts nothing when stopped first."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from launcher.backends.keeper import keeper_argv

# the kept child: counts the SIGTERMs it gets in a file, lives a second after the first one
CHILD = textwrap.dedent("""
    import signal, sys, time
    out = sys.argv[1]
    first = []
    def on_term(signum, frame):
        first.append(time.monotonic())
        with open(out, "a") as f:
            f.write("TERM\\n")
    signal.signal(signal.SIGTERM, on_term)
    open(out + ".ready", "w").close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (first and time.monotonic() - first[0] > 1.0):
        time.sleep(0.01)
""")

# dlaunch's shape: a process with several threads starts the keeper, tied to it by SIGKILL
PARENT = textwrap.dedent("""
    import signal, subprocess, sys, threading, time
    from launcher.backends.keeper import keeper_argv, tie_to_parent
    for _ in range(8):
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
    subprocess.Popen(keeper_argv(sys.executable, [sys.executable, sys.argv[1], sys.argv[2]]),
                     start_new_session=True, preexec_fn=tie_to_parent(signal.SIGKILL))
    time.sleep(60)
""")


def _wait_for(path: Path, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def test_a_sigkilled_parent_with_many_threads_reaches_torchrun_once(tmp_path: Path):
    child, parent, out = tmp_path / "child.py", tmp_path / "parent.py", tmp_path / "terms"
    child.write_text(CHILD)
    parent.write_text(PARENT)
    proc = subprocess.Popen([sys.executable, str(parent), str(child), str(out)])
    _wait_for(Path(f"{out}.ready"))
    proc.kill()
    proc.wait()
    _wait_for(out)
    time.sleep(1.5)  # further signals, if any, would come within this
    assert out.read_text().splitlines() == ["TERM"]


def test_the_keeper_exits_as_its_child_did(tmp_path: Path):
    assert subprocess.run(keeper_argv(sys.executable, [sys.executable, "-c", "raise SystemExit(3)"])).returncode == 3
    killed = subprocess.run(keeper_argv(sys.executable, [
        sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGUSR1)"]))
    assert killed.returncode == -signal.SIGUSR1


def test_a_sigterm_to_the_keeper_is_passed_on_once(tmp_path: Path):
    child, out = tmp_path / "child.py", tmp_path / "terms"
    child.write_text(CHILD)
    keeper = subprocess.Popen(keeper_argv(sys.executable, [sys.executable, str(child), str(out)]))
    _wait_for(Path(f"{out}.ready"))
    keeper.send_signal(signal.SIGTERM)
    assert keeper.wait(timeout=20) == 0  # the child handled it, lived on a second and finished
    assert out.read_text().splitlines() == ["TERM"]

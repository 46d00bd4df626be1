#!/usr/bin/env bash
# The two set-up commands of the README:
#   bash scripts/dev.sh demo   create .venv, install dlaunch, run a 2-process training run
#   bash scripts/dev.sh test   create .venv, install dlaunch with test deps, lint (ruff), type-check (mypy), run the test suite
# Needs only bash and Python >= 3.10 with venv. On a machine without an NVIDIA driver it pins
# torch==2.13.0, which resolves to the CPU wheel, never the multi-gigabyte CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}

setup() {
  if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
  fi
  local stamp="$VENV/.dlaunch-installed"
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    if ! command -v nvidia-smi >/dev/null 2>&1; then
      "$VENV/bin/pip" install -q "torch==2.13.0"
    fi
    "$VENV/bin/pip" install -q -e ".[dev]"
    touch "$stamp"
  fi
  # bytecode for every process dlaunch starts (ranks, tests' subprocesses), as an installed
  # package has it: under PYTHONDONTWRITEBYTECODE=1 an editable checkout would otherwise
  # recompile its ~100 modules in each of them (~0.1 s apiece)
  "$VENV/bin/python" -m compileall -q launcher workloads benchmarks >/dev/null
}

case "${1:-}" in
  demo)
    setup
    "$VENV/bin/dlaunch" run workloads/gpt.py --gpus 2 --steps 30
    ;;
  test)
    setup
    shift
    # unused imports, undefined names, import order: pyproject's [tool.ruff] (a second, not minutes)
    "$VENV/bin/ruff" check launcher workloads tests benchmarks
    # types of launcher/: pyproject's [tool.mypy] (cached in .mypy_cache: seconds once warm)
    if [ "$#" -gt 0 ]; then
      "$VENV/bin/mypy"
      "$VENV/bin/python" -m pytest -q -rs "$@"
    else
      # mypy (one core, ~1 min cold: it reads torch's types) beside the unit tests, which wait
      # on their subprocesses part of the time; it must pass before the timed tests start
      mypy_log=$(mktemp)
      "$VENV/bin/mypy" >"$mypy_log" 2>&1 &
      mypy_pid=$!
      trap 'kill "$mypy_pid" 2>/dev/null || true' EXIT
      # unit tests start no torchrun and time nothing: two workers halve their minutes
      # --durations: the slowest tests in the log, where the suite's 25-minute budget goes
      "$VENV/bin/python" -m pytest -q -rs -n 2 --durations=10 tests/unit
      mypy_rc=0
      wait "$mypy_pid" || mypy_rc=$?
      trap - EXIT  # mypy is done: its pid may be another process's from here on
      cat "$mypy_log"
      rm -f "$mypy_log"
      [ "$mypy_rc" -eq 0 ] || exit "$mypy_rc"
      # the torchrun tests on two workers, a module to a worker at a time (its fixtures run once),
      # under a short base directory (DataLoader workers' socket paths must stay under 108 bytes);
      # then, one at a time, the tests marked `alone`: they time steps against a clock, or share
      # the one local SLURM cluster. The second pass runs whatever the first gave (a red test there
      # must not hide the rest); the script then exits with a failing pass's code
      basetemp=$(mktemp -d /tmp/dlt.XXXXXX)
      rc=0
      "$VENV/bin/python" -m pytest -q -rs -n 2 --dist loadscope --basetemp="$basetemp" --durations=25 \
        -m "not alone" tests/integration || rc=$?
      "$VENV/bin/python" -m pytest -q -rs --durations=15 -m alone tests/integration tests/slurm || rc=$?
      rm -rf "$basetemp"
      exit "$rc"
    fi
    ;;
  *)
    echo "usage: bash scripts/dev.sh demo|test [pytest args]" >&2
    exit 2
    ;;
esac

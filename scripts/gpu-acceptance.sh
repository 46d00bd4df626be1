#!/usr/bin/env bash
# The GPU acceptance run: dlaunch's CUDA path end to end on one GPU machine, one table at the end.
#
#   bash scripts/gpu-acceptance.sh          on a GPU host: gpt `small`, ~4-6 minutes on one H100
#   bash scripts/gpu-acceptance.sh --cpu    the CPU dry mode CI runs: the same steps on gpt `tiny`,
#                                           one CPU rank, a few steps (checks the plumbing and the table)
#
# Needs only python3 with torch, pyyaml, psutil (nvidia-ml-py where there is a GPU); dlaunch runs
# from this checkout (PYTHONPATH), nothing is installed, nothing is fetched. Every step has its own
# time limit and a failing step does not stop the others: the table says what failed.
#
# Writes at most 8 files to $ACCEPT_OUT (default: $OUT when set, else runs/gpu-acceptance):
#   table.md        predicted against measured, per run; the profiler's device time against the trace
#   log.txt         every command and everything it printed
#   inspect.json    dlaunch inspect --json
#   doctor.json     dlaunch doctor --json
#   plan.json       dlaunch plan --json of the workload
#   results.json    each run's result.json, by name
#   runs.tar.gz     the run dirs' records (rank JSONL, summaries, plan.json; no traces or pickles)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

MODE=gpu
case "${1:-}" in
  --cpu) MODE=cpu ;;
  "") ;;
  *) echo "usage: bash scripts/gpu-acceptance.sh [--cpu]" >&2; exit 2 ;;
esac

PY=${PYTHON:-python3}
OUTDIR=${ACCEPT_OUT:-${OUT:-runs/gpu-acceptance}}
WORK=${ACCEPT_WORK:-$(mktemp -d "${TMPDIR:-/tmp}/dlaunch-accept.XXXXXX")}
mkdir -p "$OUTDIR" "$WORK"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# on a GPU the profile and probe caches start empty: the run measures what a new user gets; the
# CPU dry mode checks the plumbing and keeps the cache dlaunch uses by default (a suite's, warm)
if [ "$MODE" = gpu ]; then
  export DLAUNCH_CACHE_DIR="$WORK/cache"
fi
LOG="$OUTDIR/log.txt"
: >"$LOG"

if [ "$MODE" = gpu ]; then
  WL_ARGS=(-- --size small); STEPS=20; TLIM=240; OOM_MB=1024
  RUN_FLAGS=(--gpus 1)
else
  # 32 tokens: a CPU without native bf16 (no avx512_bf16) runs bf16 matmuls ~50x slower than
  # fp32, and four of the six runs are bf16
  WL_ARGS=(-- --size tiny --seq-len 32); STEPS=6; TLIM=180; OOM_MB=4
  RUN_FLAGS=(--gpus 1 --micro-batch 2)
fi
WL=(workloads/gpt.py)

DL=("$PY" -m launcher.cli)

# step NAME LIMIT_S OUTFILE CMD...: runs CMD with a time limit, stdout to OUTFILE (or the log),
# stderr to the log; records the exit code and the wall time
declare -a STEP_LINES=()
# ACCEPT_BUDGET_S: the whole run's seconds; a step that would start after it is skipped (exit
# 125) and the table is still written, so a lease that is running out still brings back a table
DEADLINE=$(( $(date +%s) + ${ACCEPT_BUDGET_S:-3600} ))
step() {
  local name=$1 limit=$2 out=$3; shift 3
  local t0 rc
  if [ "$(date +%s)" -ge "$DEADLINE" ]; then
    echo "=== $name: skipped, past ACCEPT_BUDGET_S" >>"$LOG"
    STEP_LINES+=("$name	125	0")
    return
  fi
  local left=$(( DEADLINE - $(date +%s) ))
  if [ "$left" -lt "$limit" ]; then limit=$left; fi
  t0=$(date +%s.%N)
  {
    echo
    echo "=== $name: $*"
  } >>"$LOG"
  if [ "$out" = - ]; then
    timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1; rc=$?
  else
    timeout --kill-after=10 "$limit" "$@" >"$out" 2>>"$LOG"; rc=$?
  fi
  local wall
  wall=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')
  echo "=== $name: exit $rc after ${wall} s" >>"$LOG"
  echo "step $name: exit $rc, ${wall} s" >&2
  STEP_LINES+=("$name	$rc	$wall")
}

{
  echo "dlaunch GPU acceptance, mode $MODE, $(date -u +%FT%TZ)"
  "$PY" - <<'EOF'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "devices", torch.cuda.device_count(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu")
EOF
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
} >>"$LOG" 2>&1

step inspect 60 "$OUTDIR/inspect.json" "${DL[@]}" inspect --json
step doctor 120 "$OUTDIR/doctor.json" "${DL[@]}" doctor --gpus 1 --json
step plan 180 "$OUTDIR/plan.json" "${DL[@]}" plan "${WL[@]}" --gpus 1 --json "${WL_ARGS[@]}"
step plan-text 120 - "${DL[@]}" plan "${WL[@]}" --gpus 1 "${WL_ARGS[@]}"

# name: flags (every decision given, so each run is the same on any host)
# (compile is the plan's choice on a GPU: every run but one says which it wants)
RUNS=(
  "fp32|--strategy ddp --precision fp32 --checkpointing none --no-compile"
  "bf16|--strategy ddp --precision bf16 --checkpointing none --no-compile"
  "bf16-compile|--strategy ddp --precision bf16 --checkpointing none --compile"
  "fsdp-1gpu|--strategy fsdp_full --precision bf16 --checkpointing none --no-compile"
  "profile|--strategy ddp --precision bf16 --checkpointing none --no-compile --profile"
  # on a GPU: out of memory, the snapshot written; on CPU (no CUDA allocator) the option is
  # refused in one line with exit 2, which the table checks
  "oom-snapshot|--strategy ddp --precision bf16 --checkpointing none --no-compile --micro-batch $OOM_MB --memory-snapshot"
)
if [ "$MODE" = gpu ]; then
  # float8 (torchao's Float8Linear, compiled, FSDP's float8 all-gather): needs torchao on the
  # device (pip install 'dlaunch[float8]', or its wheel carried over); without it one line, exit 2
  RUNS+=("float8|--strategy fsdp_full --precision bf16 --float8 tensorwise --checkpointing none --compile")
fi
for entry in "${RUNS[@]}"; do
  name=${entry%%|*}
  read -r -a flags <<<"${entry#*|}"
  step "run-$name" "$TLIM" "$WORK/$name.json" \
    "${DL[@]}" run "${WL[@]}" "${RUN_FLAGS[@]}" --steps "$STEPS" "${flags[@]}" \
    --run-dir "$WORK/runs/$name" --force --json "${WL_ARGS[@]}"
done

if [ "$MODE" = gpu ]; then
  # CPU offload: a 7B model on one GPU, its fp32 state in host memory (~100 GiB; the plan refuses
  # a host without it in one line)
  step run-offload-7b 420 "$WORK/offload-7b.json" \
    "${DL[@]}" run "${WL[@]}" --gpus 1 --steps 6 --strategy fsdp_full --offload --precision bf16 \
    --checkpointing full --micro-batch 1 --no-compile --run-dir "$WORK/runs/offload-7b" --force --json \
    -- --size llama2-7b --seq-len 2048
fi

printf '%s\n' "${STEP_LINES[@]}" >"$WORK/steps.tsv"
"$PY" benchmarks/gpu_acceptance_table.py --work "$WORK" --steps "$WORK/steps.tsv" --mode "$MODE" \
  --results "$OUTDIR/results.json" >"$OUTDIR/table.md" 2>>"$LOG"
table_rc=$?
# the records, without traces and snapshots (they can be large; the table has their numbers)
tar -C "$WORK" --exclude='*.pickle' --exclude='trace-rank*.json' -czf "$OUTDIR/runs.tar.gz" runs 2>>"$LOG"
cat "$OUTDIR/table.md"
exit $table_rc

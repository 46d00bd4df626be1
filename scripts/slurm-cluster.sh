#!/usr/bin/env bash
# scripts/slurm-cluster.sh — a real single-host SLURM 22.05 test cluster for dlaunch
# (Debian 12, run as root, no systemd needed).
#
#   scripts/slurm-cluster.sh up       install packages if missing, start everything, smoke test
#   scripts/slurm-cluster.sh down     cancel all jobs, stop the daemons this script started
#   scripts/slurm-cluster.sh status   exit 0 if the cluster is up and healthy, 1 otherwise
#
# Layout: munged + MariaDB + slurmdbd (so `sacct` works) + slurmctld + two slurmd processes that
# play the nodes n1 and n2 (ports 17001/17002, both 127.0.0.1; `127.0.0.1 n1 n2` goes into
# /etc/hosts). One partition, `debug` (default). Config: /etc/slurm/slurm.conf, slurmdbd.conf.
#
# State, logs and PID files live under ${DLAUNCH_SLURM_BASE:-/tmp/dlaunch-slurm}:
#   run/<daemon>.pid   PID of every daemon this script started (only these are ever stopped)
#   run/hosts.added    the exact /etc/hosts line this script appended (removed again by `down`)
#   log/               daemon logs, apt logs
#   state/             slurmctld StateSaveLocation, slurmd spool dirs (wiped on every fresh `up`)
#
# `up` is idempotent: if the cluster it started is up and healthy it returns 0 at once; if a
# stale one is half up it is stopped and started fresh. The accounting DB (slurm_acct_db) is
# dropped on every fresh start, because job ids restart at 1 with a fresh StateSaveLocation.
# A munged or mariadbd that was already running (not started here) is reused and left running.
#
# Environment:
#   DLAUNCH_SLURM_BASE         state directory (default /tmp/dlaunch-slurm)
#   DLAUNCH_SLURM_KEEP_FAILED  1: on a failed `up`, leave the daemons running for debugging
#
# Exit status: 0 ok; 1 failure (the last stderr line is
# "dlaunch-slurm: FAILED at step '<step>': <reason>", preceded by the tail of the relevant log);
# 2 usage error; 3 prerequisites missing (not root, no apt-get, package install failed).
set -euo pipefail
set -o errtrace

BASE=${DLAUNCH_SLURM_BASE:-/tmp/dlaunch-slurm}
BASE=${BASE%/}
RUN=$BASE/run
LOG=$BASE/log
STATE=$BASE/state
SLURM_CONF=/etc/slurm/slurm.conf
DBD_CONF=/etc/slurm/slurmdbd.conf
CONF_MARKER="# dlaunch-slurm-cluster BASE=$BASE"
CLUSTER_NAME=dlaunch
PARTITION=debug
NODES=(n1 n2)
NODE_PORTS=(17001 17002)
HOSTS_LINE="127.0.0.1 n1 n2"
PKGS=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server)
DB_NAME=slurm_acct_db
DB_USER=slurm
DB_PASS=slurmpw
# name in run/<name>.pid -> process name (/proc/<pid>/comm); stop order of `down`
STOP_ORDER=(slurmd-n2 slurmd-n1 slurmctld slurmdbd mariadbd munged)
declare -A COMM=([slurmd-n1]=slurmd [slurmd-n2]=slurmd [slurmctld]=slurmctld
                 [slurmdbd]=slurmdbd [mariadbd]=mariadbd [munged]=munged)

STEP=init
FAILING=0

# ---------------------------------------------------------------------------- helpers
now() { date +%s.%N; }
T0=$(now)
TP=$T0
# phase <message>: "[ total] message (+since last phase)"
phase() {
  local t; t=$(now)
  awk -v n="$t" -v a="$T0" -v p="$TP" -v m="$*" \
    'BEGIN { printf "[%6.2fs] %-52s (+%.2fs)\n", n - a, m, n - p }'
  TP=$t
}
info() { echo "dlaunch-slurm: $*"; }
warn() { echo "dlaunch-slurm: warning: $*" >&2; }

# fail <exit-code> <reason> [log files to show...]
fail() {
  local code=$1 msg=$2 f
  shift 2
  trap - ERR
  for f in "$@"; do
    if [ -s "$f" ]; then
      echo "---- last 30 lines of $f ----" >&2
      tail -n 30 "$f" >&2 || true
      echo "----" >&2
    fi
  done
  if [ "$FAILING" = 0 ] && [ "${CLEANING_ON_FAIL:-0}" = 1 ] && [ "${DLAUNCH_SLURM_KEEP_FAILED:-0}" != 1 ]; then
    FAILING=1
    echo "dlaunch-slurm: stopping what this failed 'up' started (logs stay in $LOG)" >&2
    stop_cluster >&2 || true
  fi
  echo "dlaunch-slurm: FAILED at step '$STEP': $msg" >&2
  exit "$code"
}
on_err() {
  local rc=$? cmd=$BASH_COMMAND
  fail 1 "command failed (exit $rc): $cmd"
}
trap on_err ERR

# alive <pid>: running and not a zombie
alive() {
  local st
  [[ "$1" =~ ^[0-9]+$ ]] || return 1
  st=$(ps -o stat= -p "$1" 2>/dev/null) || return 1
  [ -n "$st" ] && [[ "$st" != Z* ]]
}
# ours <name>: the daemon recorded in run/<name>.pid is alive and still that program
ours() {
  local f=$RUN/$1.pid pid
  [ -f "$f" ] || return 1
  pid=$(cat "$f" 2>/dev/null) || return 1
  alive "$pid" && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "${COMM[$1]}" ]
}
# wait_for <timeout_s> <pid or -> <cmd...>: poll cmd until it succeeds.
# returns 1 on timeout, 2 if <pid> died meanwhile
wait_for() {
  local limit=$1 pid=$2 end
  shift 2
  end=$(( $(date +%s) + limit ))
  until "$@" >/dev/null 2>&1; do
    if [ "$pid" != - ] && ! alive "$pid"; then return 2; fi
    [ "$(date +%s)" -lt "$end" ] || return 1
    sleep 0.2
  done
}
# start_daemon <name> <log> <cmd...>: start in its own session, detached from our stdio and
# lock fd, and record its PID in run/<name>.pid
start_daemon() {
  local name=$1 logf=$2 pid
  shift 2
  setsid nohup "$@" </dev/null >"$logf" 2>&1 9>&- &
  pid=$!
  echo "$pid" >"$RUN/$name.pid"
  sleep 0.05
  if alive "$pid" && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" != "${COMM[$name]}" ]; then
    sleep 0.3   # still between fork and exec
  fi
  alive "$pid" || fail 1 "$name exited right after start" "$logf"
}
# check_started <name> <rc of wait_for> <what> <logs...>
check_started() {
  local name=$1 rc=$2 what=$3
  shift 3
  case $rc in
    0) return 0 ;;
    2) fail 1 "$name (pid $(cat "$RUN/$name.pid")) died while waiting for: $what" "$@" ;;
    *) fail 1 "timed out waiting for: $what" "$@" ;;
  esac
}

munge_ok() { timeout 5 sh -c 'munge -n | unmunge' >/dev/null 2>&1; }
mariadb_ok() { timeout 5 mariadb -e 'select 1' >/dev/null 2>&1; }
dbd_ok() { timeout 5 sacctmgr -n show cluster >/dev/null 2>&1; }
# (grep without -q in pipes: with pipefail, an early grep exit could SIGPIPE the writer)
ctld_ok() { timeout 5 scontrol ping 2>/dev/null | grep 'is UP' >/dev/null; }
cluster_registered() { timeout 5 sacctmgr -n -P show cluster format=cluster 2>/dev/null | grep -x "$CLUSTER_NAME" >/dev/null; }
nodes_idle() { [ "$(timeout 5 sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l)" = "${#NODES[@]}" ]; }
# nodes up (idle, allocated, mixed, completing; not down/drained/not responding)
nodes_usable() {
  local out n
  out=$(timeout 5 sinfo -h -N -o '%N %T' 2>/dev/null) || return 1
  for n in "${NODES[@]}"; do
    grep -E "^$n (idle|allocated|mixed|completing)$" <<<"$out" >/dev/null || return 1
  done
}
hosts_resolve() {
  local n
  for n in "${NODES[@]}"; do
    [ "$(getent ahostsv4 "$n" 2>/dev/null | awk 'NR==1 {print $1}')" = 127.0.0.1 ] || return 1
  done
}

# healthy: the cluster this script started (for this BASE) is up and answering
healthy() {
  local n
  [ -f "$RUN/up.ok" ] || return 1
  grep -qxF "$CONF_MARKER" "$SLURM_CONF" 2>/dev/null || return 1
  for n in slurmd-n1 slurmd-n2 slurmctld slurmdbd; do ours "$n" || return 1; done
  if [ -f "$RUN/mariadbd.pid" ]; then ours mariadbd || return 1; fi
  if [ -f "$RUN/munged.pid" ]; then ours munged || return 1; fi
  munge_ok && ctld_ok && dbd_ok && nodes_usable && hosts_resolve
}

lock() {
  mkdir -p "$BASE"
  exec 9>"$BASE/lock"
  flock -w 600 9 || fail 1 "another 'up'/'down' holds $BASE/lock for 600 s"
}

require_root() {
  [ "$(id -u)" = 0 ] || fail 3 "must run as root (uid is $(id -u)): it installs packages, writes /etc/slurm and /etc/hosts"
}

# ---------------------------------------------------------------------------- stop
# stop_daemon <name>: TERM, wait up to 20 s, KILL. Only the PID recorded in run/<name>.pid.
stop_daemon() {
  local name=$1 f=$RUN/$1.pid pid t0 i
  [ -f "$f" ] || return 0
  pid=$(cat "$f" 2>/dev/null || true)
  if ours "$name"; then
    t0=$(now)
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 200); do alive "$pid" || break; sleep 0.1; done
    if alive "$pid"; then
      warn "$name (pid $pid) still alive 20 s after SIGTERM, sending SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
      for i in $(seq 50); do alive "$pid" || break; sleep 0.1; done
    fi
    alive "$pid" && fail 1 "could not stop $name (pid $pid)"
    awk -v a="$t0" -v b="$(now)" -v m="stopped $name (pid $pid)" 'BEGIN { printf "  %-40s %.2fs\n", m, b - a }'
  else
    echo "  $name (pid $pid) was not running"
  fi
  rm -f "$f"
}

cancel_jobs() {
  local t0 ids i
  ours slurmctld || return 0
  if ! ctld_ok; then
    warn "slurmctld (pid $(cat "$RUN/slurmctld.pid")) does not answer; cannot cancel jobs"
    return 0
  fi
  t0=$(now)
  ids=$(timeout 10 squeue -h -o %i 2>/dev/null || true)
  if [ -z "$ids" ]; then echo "  no jobs in the queue"; return 0; fi
  # shellcheck disable=SC2086
  timeout 10 scancel $ids 2>/dev/null || true
  # KillWait=5: jobs that ignore SIGTERM (submitit does) are SIGKILLed after 5 s
  for i in $(seq 300); do
    [ -z "$(timeout 5 squeue -h -o %i 2>/dev/null || true)" ] && break
    sleep 0.1
  done
  if [ -n "$(timeout 5 squeue -h -o %i 2>/dev/null || true)" ]; then
    warn "jobs still in the queue 30 s after scancel: $(timeout 5 squeue -h -o '%i:%T' | tr '\n' ' ')"
  fi
  awk -v a="$t0" -v b="$(now)" -v m="cancelled jobs: $(echo "$ids" | tr '\n' ' ')" 'BEGIN { printf "  %-40s %.2fs\n", m, b - a }'
}

remove_hosts_line() {
  local f=$RUN/hosts.added line
  [ -f "$f" ] || return 0
  line=$(cat "$f")
  # drop the last line that is exactly what we appended; rewrite in place (keeps the inode,
  # /etc/hosts is often a bind mount in containers)
  awk -v l="$line" '{ a[NR] = $0; if ($0 == l) last = NR }
                    END { for (i = 1; i <= NR; i++) if (i != last) print a[i] }' /etc/hosts >"$RUN/hosts.new"
  cat "$RUN/hosts.new" >/etc/hosts
  rm -f "$RUN/hosts.new" "$f"
  echo "  removed '$line' from /etc/hosts"
}

restore_conf() {
  local c
  for c in "$SLURM_CONF" "$DBD_CONF"; do
    # only replace a config that this BASE wrote
    if [ -f "$c.dlaunch-orig" ] && { [ ! -e "$c" ] || grep -qxF "$CONF_MARKER" "$c"; }; then
      mv -f "$c.dlaunch-orig" "$c"
      echo "  restored $c"
    fi
  done
}

# kill_leftover_steps: job steps survive their slurmd (pitfall 12). A slurmstepd of this cluster
# holds its node's log file ($LOG/slurmd-<node>.log) open; kill its whole session (the step and
# its tasks). Normally there is none left, because cancel_jobs ran first.
kill_leftover_steps() {
  local p sid pids fd mine
  for p in $(pgrep -x slurmstepd || true); do
    mine=0
    for fd in "/proc/$p/fd/"*; do
      case $(readlink "$fd" 2>/dev/null) in "$LOG"/slurmd-*) mine=1; break ;; esac
    done
    [ "$mine" = 1 ] || continue
    sid=$(ps -o sid= -p "$p" | tr -d ' ') || continue
    [ -n "$sid" ] || continue
    pids=$(ps -eo pid=,sid= | awk -v s="$sid" '$2 == s { print $1 }')
    warn "killing leftover job step session $sid (pids: $(echo "$pids" | tr '\n' ' '))"
    # shellcheck disable=SC2086
    kill -KILL $pids 2>/dev/null || true
  done
}

# stop_cluster: everything this script started, newest first
stop_cluster() {
  local n
  rm -f "$RUN/up.ok"
  cancel_jobs
  for n in "${STOP_ORDER[@]}"; do
    stop_daemon "$n"
    if [ "$n" = slurmd-n1 ]; then kill_leftover_steps; fi
  done
  rm -f "$RUN"/*.foreign
  remove_hosts_line
  restore_conf
}

# ---------------------------------------------------------------------------- up
install_packages() {
  local missing=() p
  for p in "${PKGS[@]}"; do
    [ "$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)" = installed ] || missing+=("$p")
  done
  if [ ${#missing[@]} = 0 ]; then
    phase "packages already installed"
    return 0
  fi
  command -v apt-get >/dev/null || fail 3 "apt-get not found; cannot install: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  local apt=(apt-get -y -q -o DPkg::Lock::Timeout=300)
  info "installing ${missing[*]} (log: $LOG/apt-install.log)"
  if ! "${apt[@]}" install --no-install-recommends "${missing[@]}" >"$LOG/apt-install.log" 2>&1; then
    phase "apt-get install failed without update"
    STEP="apt-get update"
    "${apt[@]}" update >"$LOG/apt-update.log" 2>&1 \
      || fail 3 "apt-get update failed ($(grep -m1 -E '^(E|Err):' "$LOG/apt-update.log" || echo "see $LOG/apt-update.log"))" "$LOG/apt-update.log"
    phase "apt-get update"
    STEP="apt-get install"
    "${apt[@]}" install --no-install-recommends "${missing[@]}" >>"$LOG/apt-install.log" 2>&1 \
      || fail 3 "apt-get install ${missing[*]} failed ($(grep -m1 '^E:' "$LOG/apt-install.log" || echo "see $LOG/apt-install.log"))" "$LOG/apt-install.log"
  fi
  phase "apt-get install ${missing[*]}"
}

check_binaries() {
  local b miss=()
  for b in munged munge unmunge mariadbd mariadb slurmdbd slurmctld slurmd srun sinfo squeue sacct sacctmgr scontrol scancel; do
    command -v "$b" >/dev/null || [ -x "/usr/sbin/$b" ] || miss+=("$b")
  done
  [ ${#miss[@]} = 0 ] || fail 3 "programs missing after install: ${miss[*]}"
}

check_ports_free() {
  local p busy=() other
  for p in 6817 6819 "${NODE_PORTS[@]}"; do
    if ss -Hltn "sport = :$p" 2>/dev/null | grep . >/dev/null; then busy+=("$p"); fi
  done
  [ ${#busy[@]} = 0 ] && return 0
  other=$(sed -n 's/^# dlaunch-slurm-cluster BASE=//p' "$SLURM_CONF" 2>/dev/null | head -1)
  fail 1 "TCP port(s) ${busy[*]} already in use by daemons this script did not start for BASE=$BASE$( \
    [ -n "$other" ] && [ "$other" != "$BASE" ] && echo " (a cluster was started with DLAUNCH_SLURM_BASE=$other: run 'DLAUNCH_SLURM_BASE=$other $0 down')")"
}

start_munge() {
  if munge_ok; then
    touch "$RUN/munged.foreign"
    phase "munged already running (not ours, reused)"
    return 0
  fi
  [ -s /etc/munge/munge.key ] || mungekey --create --keyfile=/etc/munge/munge.key >/dev/null
  chown munge:munge /etc/munge/munge.key
  chmod 0400 /etc/munge/munge.key
  install -d -o munge -g munge -m 0755 /run/munge
  rm -f /run/munge/munged.pid
  # munged daemonizes itself and writes /run/munge/munged.pid
  runuser -u munge -- /usr/sbin/munged </dev/null >"$LOG/munged.stdout" 2>&1 9>&- \
    || fail 1 "munged did not start" "$LOG/munged.stdout" /var/log/munge/munged.log
  local rc=0
  wait_for 10 - munge_ok || rc=$?
  [ $rc = 0 ] || fail 1 "munge -n | unmunge does not work" /var/log/munge/munged.log
  local pid
  pid=$(cat /run/munge/munged.pid 2>/dev/null || true)
  [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = munged ] || fail 1 "cannot find the PID of munged (/run/munge/munged.pid: '$pid')"
  echo "$pid" >"$RUN/munged.pid"
  phase "munged up (pid $pid)"
}

add_hosts_line() {
  if hosts_resolve; then
    phase "n1 n2 already resolve to 127.0.0.1"
    return 0
  fi
  # keep the file well formed if its last line has no newline
  if [ -s /etc/hosts ] && [ -n "$(tail -c 1 /etc/hosts)" ]; then echo >>/etc/hosts; fi
  echo "$HOSTS_LINE" >>/etc/hosts
  echo "$HOSTS_LINE" >"$RUN/hosts.added"
  hosts_resolve || fail 1 "added '$HOSTS_LINE' to /etc/hosts but n1/n2 still do not resolve to 127.0.0.1 (an earlier line wins?)"
  phase "added '$HOSTS_LINE' to /etc/hosts"
}

write_configs() {
  local c host
  mkdir -p /etc/slurm
  for c in "$SLURM_CONF" "$DBD_CONF"; do
    # keep a config that this script did not write, and put it back on `down`
    if [ -f "$c" ] && ! grep -q '^# dlaunch-slurm-cluster BASE=' "$c" && [ ! -e "$c.dlaunch-orig" ]; then
      cp -p "$c" "$c.dlaunch-orig"
      warn "saved the existing $c as $c.dlaunch-orig (restored by 'down')"
    fi
  done
  host=$(hostname -s)
  cat >"$SLURM_CONF" <<EOF
$CONF_MARKER
# Written by scripts/slurm-cluster.sh; do not edit (rewritten on every fresh 'up').
ClusterName=$CLUSTER_NAME
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# requeued jobs wait cred_expire+1 s before they may start again (default 120)
AuthInfo=cred_expire=10
MailProg=/bin/true
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/slurmd-%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# trust CPUs/RealMemory below instead of the hardware (two slurmd share one host)
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# start jobs at once (default batch_sched_delay=3 delays back-to-back sbatch by ~3 s)
SchedulerParameters=batch_sched_delay=0,sched_interval=1,bf_interval=1
ReturnToService=2
# submitit ignores SIGTERM, so scancel only takes effect after KillWait (default 30 s)
KillWait=5
# keep finished jobs in slurmctld memory (scontrol show job) for an hour
MinJobAge=3600
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName=n1 NodeHostname=$host NodeAddr=127.0.0.1 Port=${NODE_PORTS[0]} CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=4000 State=UNKNOWN
NodeName=n2 NodeHostname=$host NodeAddr=127.0.0.1 Port=${NODE_PORTS[1]} CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=4000 State=UNKNOWN
PartitionName=$PARTITION Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
EOF
  chmod 644 "$SLURM_CONF"
  # slurmdbd refuses a slurmdbd.conf with a password that others can read
  (umask 077; cat >"$DBD_CONF" <<EOF
$CONF_MARKER
AuthType=auth/munge
DbdHost=localhost
DbdPort=6819
SlurmUser=root
LogFile=$LOG/slurmdbd.log
PidFile=$STATE/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageLoc=$DB_NAME
StorageUser=$DB_USER
StoragePass=$DB_PASS
EOF
  )
  chmod 600 "$DBD_CONF"
  phase "wrote $SLURM_CONF, $DBD_CONF"
}

start_mariadb() {
  local rc=0
  if mariadb_ok >/dev/null 2>&1; then
    touch "$RUN/mariadbd.foreign"
    phase "mariadbd already running (not ours, reused)"
  else
    if [ ! -d /var/lib/mysql/mysql ]; then
      mariadb-install-db --user=mysql --datadir=/var/lib/mysql >"$LOG/mariadb-install-db.log" 2>&1 \
        || fail 1 "mariadb-install-db failed" "$LOG/mariadb-install-db.log"
    fi
    install -d -o mysql -g mysql -m 0755 /run/mysqld
    start_daemon mariadbd "$LOG/mariadb.log" /usr/sbin/mariadbd --user=mysql --bind-address=127.0.0.1
    wait_for 60 "$(cat "$RUN/mariadbd.pid")" mariadb_ok || rc=$?
    check_started mariadbd $rc "mariadb -e 'select 1'" "$LOG/mariadb.log"
    phase "mariadbd up (pid $(cat "$RUN/mariadbd.pid"))"
  fi
  # job ids restart at 1 with a fresh StateSaveLocation: drop old accounting records, or
  # `sacct -j N` may report an earlier cluster's job N
  mariadb -e "DROP DATABASE IF EXISTS $DB_NAME;
              CREATE USER IF NOT EXISTS '$DB_USER'@'localhost' IDENTIFIED BY '$DB_PASS';
              GRANT ALL ON $DB_NAME.* TO '$DB_USER'@'localhost'; FLUSH PRIVILEGES;" >"$LOG/mariadb-setup.log" 2>&1 \
    || fail 1 "could not reset the accounting database" "$LOG/mariadb-setup.log"
  phase "dropped + re-granted accounting DB $DB_NAME"
}

start_slurm() {
  local rc=0 n i
  start_daemon slurmdbd "$LOG/slurmdbd.stdout" slurmdbd -D
  wait_for 60 "$(cat "$RUN/slurmdbd.pid")" dbd_ok || rc=$?
  check_started slurmdbd $rc "sacctmgr show cluster (slurmdbd answering)" "$LOG/slurmdbd.log" "$LOG/slurmdbd.stdout"
  phase "slurmdbd up (pid $(cat "$RUN/slurmdbd.pid"))"

  start_daemon slurmctld "$LOG/slurmctld.stdout" slurmctld -D
  wait_for 60 "$(cat "$RUN/slurmctld.pid")" ctld_ok || rc=$?
  check_started slurmctld $rc "scontrol ping" "$LOG/slurmctld.log" "$LOG/slurmctld.stdout"
  phase "slurmctld up (pid $(cat "$RUN/slurmctld.pid"))"

  for i in "${!NODES[@]}"; do
    n=${NODES[$i]}
    mkdir -p "$STATE/slurmd-$n"
    start_daemon "slurmd-$n" "$LOG/slurmd-$n.stdout" slurmd -D -N "$n"
  done
  for n in "${NODES[@]}"; do
    # a slurmd that dies at once is reported with its own log
    alive "$(cat "$RUN/slurmd-$n.pid")" || fail 1 "slurmd -N $n exited" "$LOG/slurmd-$n.log" "$LOG/slurmd-$n.stdout"
  done
  wait_for 60 - nodes_idle || rc=$?
  if [ $rc != 0 ]; then
    timeout 5 sinfo -N >&2 || true
    fail 1 "nodes ${NODES[*]} not idle after 60 s" "$LOG/slurmctld.log" "$LOG/slurmd-n1.log" "$LOG/slurmd-n2.log"
  fi
  phase "slurmd n1 (pid $(cat "$RUN/slurmd-n1.pid")), n2 (pid $(cat "$RUN/slurmd-n2.pid")) idle"
  wait_for 30 - cluster_registered || rc=$?
  [ $rc = 0 ] || fail 1 "slurmctld did not register cluster '$CLUSTER_NAME' with slurmdbd" "$LOG/slurmctld.log" "$LOG/slurmdbd.log"
  phase "cluster '$CLUSTER_NAME' registered in slurmdbd"
}

smoke_test() {
  local out
  STEP="smoke test (srun -N2 hostname)"
  out=$(timeout 60 srun -N2 -l hostname 2>"$LOG/smoke.err") \
    || fail 1 "srun -N2 -l hostname failed" "$LOG/smoke.err" "$LOG/slurmctld.log" "$LOG/slurmd-n1.log" "$LOG/slurmd-n2.log"
  echo "$out" | sed 's/^/  srun: /'
  [ "$(echo "$out" | wc -l)" = 2 ] || fail 1 "srun -N2 hostname printed $(echo "$out" | wc -l) lines, expected 2"
  phase "smoke test srun -N2 hostname ok"
}

cmd_up() {
  local f
  STEP="preflight"
  require_root
  [ -n "$BASE" ] && [ "$BASE" != / ] || fail 2 "bad DLAUNCH_SLURM_BASE '$BASE'"
  lock
  mkdir -p "$RUN" "$LOG"
  if healthy; then
    phase "cluster already up and healthy (BASE=$BASE)"
    return 0
  fi
  if compgen -G "$RUN/*.pid" >/dev/null || [ -f "$RUN/hosts.added" ] || [ -f "$RUN/up.ok" ]; then
    STEP="stop stale cluster"
    info "a stale or half-up cluster was found under $BASE; stopping it"
    stop_cluster
    phase "stopped stale cluster"
  fi
  STEP="install packages"
  install_packages
  check_binaries

  CLEANING_ON_FAIL=1
  STEP="check ports"
  check_ports_free
  # fresh state every time (job ids restart at 1)
  rm -rf "$STATE"
  mkdir -p "$STATE/ctld" "$RUN" "$LOG"
  for f in mariadb mariadb-setup munged slurmdbd slurmctld slurmd-n1 slurmd-n2; do
    rm -f "$LOG/$f.log" "$LOG/$f.stdout"
  done
  rm -f "$LOG/smoke.err"
  STEP="munge"
  start_munge
  STEP="/etc/hosts"
  add_hosts_line
  STEP="write config"
  write_configs
  STEP="mariadb"
  start_mariadb
  STEP="slurm daemons"
  start_slurm
  smoke_test
  date -Is >"$RUN/up.ok"
  CLEANING_ON_FAIL=0
  phase "cluster up (BASE=$BASE, partition $PARTITION, nodes ${NODES[*]})"
}

cmd_down() {
  STEP="down"
  require_root
  if [ ! -d "$RUN" ]; then
    phase "nothing to stop (no $RUN)"
    return 0
  fi
  lock
  stop_cluster
  phase "cluster down"
}

cmd_status() {
  local n pid st rc=0
  echo "BASE=$BASE"
  for n in munged mariadbd slurmdbd slurmctld slurmd-n1 slurmd-n2; do
    if [ -f "$RUN/$n.pid" ]; then
      pid=$(cat "$RUN/$n.pid")
      if ours "$n"; then st="running"; else st="NOT running"; fi
      printf '  %-10s pid %-8s %s\n' "$n" "$pid" "$st"
    elif [ -f "$RUN/$n.foreign" ]; then
      printf '  %-10s %s\n' "$n" "not started by this script (reused)"
    else
      printf '  %-10s %s\n' "$n" "-"
    fi
  done
  if healthy; then
    echo "healthy: yes"
    timeout 5 sinfo -N || true
    timeout 5 squeue || true
  else
    echo "healthy: no"
    rc=1
  fi
  return $rc
}

case "${1:-}" in
  up) cmd_up ;;
  down) cmd_down ;;
  status) trap - ERR; cmd_status ;;
  *) echo "usage: $0 up|down|status   (state: \${DLAUNCH_SLURM_BASE:-/tmp/dlaunch-slurm})" >&2; exit 2 ;;
esac

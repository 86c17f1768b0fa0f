#!/usr/bin/env bash
# A real single-node Slurm (munged + slurmctld + slurmd) on localhost, for the test suite.
#
#   tools/local_slurm.sh install   install the distribution's packages if they are missing (apt)
#   tools/local_slurm.sh start     install if needed, configure, start the daemons, wait until the
#                                  node is idle (idempotent: a running cluster is left alone)
#   tools/local_slurm.sh stop      stop the daemons this script started
#   tools/local_slurm.sh status    print whether it runs, the config path and `sinfo`
#
# Everything (config, munge key and socket, state, spool, logs, pid files) lives under one
# directory, $KOOCHAK_SLURM_DIR (default: $TMPDIR/koochak-slurm). No systemd, no cgroup plugins
# (proctrack/linuxproc, task/none), so it runs in a container. The node advertises
# $KOOCHAK_SLURM_CPUS CPUs (default 8, more than the box may have: config_overrides), so two
# tasks of a DDP job and a few concurrent test jobs can run at once.
#
# Clients find the config through /etc/slurm/slurm.conf, which this script writes only when it
# is absent or was written by this script; otherwise export SLURM_CONF=<dir>/slurm.conf.
set -euo pipefail

DIR="${KOOCHAK_SLURM_DIR:-${TMPDIR:-/tmp}/koochak-slurm}"
CPUS="${KOOCHAK_SLURM_CPUS:-8}"
MEMORY_MB="${KOOCHAK_SLURM_MEMORY_MB:-16000}"
CONF="$DIR/slurm.conf"
SYSTEM_CONF=/etc/slurm/slurm.conf
MARKER="# written by koochak tools/local_slurm.sh"
PACKAGES=(slurmctld slurmd slurm-client munge)

say() { echo "local_slurm: $*" >&2; }
die() { say "$*"; exit 1; }

running() {  # running <pidfile>: the pid in it is alive
  [[ -s "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

install() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
     && command -v sbatch >/dev/null && command -v munged >/dev/null; then
    return 0
  fi
  command -v apt-get >/dev/null || die "slurm is not installed and apt-get is unavailable; install ${PACKAGES[*]}"
  [[ "$(id -u)" == 0 ]] || die "slurm is not installed; run as root to apt-get install ${PACKAGES[*]}"
  say "installing ${PACKAGES[*]}"
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >/dev/null
}

write_config() {
  mkdir -p "$DIR"/{state,spool,log,munge}
  chmod 700 "$DIR/munge"
  local host
  host="$(hostname -s)"
  cat >"$CONF" <<EOF
$MARKER
ClusterName=koochak-local
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
MinJobAge=300
SchedulerParameters=batch_sched_delay=0
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEMORY_MB State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
  if [[ ! -e "$SYSTEM_CONF" ]] || grep -qxF "$MARKER" "$SYSTEM_CONF"; then
    mkdir -p "$(dirname "$SYSTEM_CONF")"
    cp "$CONF" "$SYSTEM_CONF.koochak-tmp" && mv "$SYSTEM_CONF.koochak-tmp" "$SYSTEM_CONF"
  elif [[ -z "${SLURM_CONF:-}" ]]; then
    say "warning: $SYSTEM_CONF belongs to someone else; clients need SLURM_CONF=$CONF"
  fi
}

start_munge() {
  running "$DIR/munge/munged.pid" && return 0
  if [[ ! -s "$DIR/munge/munge.key" ]]; then
    if command -v mungekey >/dev/null; then
      mungekey --create --keyfile="$DIR/munge/munge.key" --force
    else
      head -c 1024 /dev/urandom >"$DIR/munge/munge.key"
    fi
    chmod 600 "$DIR/munge/munge.key"
  fi
  # --force: munged refuses to run as root (or with a key in /tmp) without it.
  munged --force --key-file="$DIR/munge/munge.key" --socket="$DIR/munge/munge.socket" \
    --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/log/munged.log" \
    --seed-file="$DIR/munge/munged.seed"
}

wait_idle() {
  local deadline=$((SECONDS + ${KOOCHAK_SLURM_START_TIMEOUT:-90})) state=""
  while ((SECONDS < deadline)); do
    state="$(SLURM_CONF="$CONF" sinfo -h -n localhost -o %t 2>/dev/null || true)"
    case "$state" in
      idle* | mix* | alloc*) return 0 ;;
      drain* | down*)  # a restarted slurmd: bring the node back (ReturnToService covers most)
        SLURM_CONF="$CONF" scontrol update nodename=localhost state=resume 2>/dev/null || true ;;
    esac
    sleep 0.5
  done
  die "node did not become idle (state '${state:-none}'); see $DIR/log/"
}

start() {
  install
  write_config
  start_munge
  if ! running "$DIR/slurmctld.pid"; then
    slurmctld -f "$CONF"
  fi
  if ! running "$DIR/slurmd.pid"; then
    slurmd -f "$CONF" -N localhost
  fi
  wait_idle
  say "running (SLURM_CONF=$CONF)"
}

stop() {
  local name pidfile
  for name in slurmd slurmctld munge/munged; do
    pidfile="$DIR/$name.pid"
    if running "$pidfile"; then
      kill "$(cat "$pidfile")"
      for _ in $(seq 50); do running "$pidfile" || break; sleep 0.1; done
    fi
  done
  say "stopped"
}

status() {  # exit 0 only when all three daemons run
  local name all_running=0
  for name in munge/munged slurmctld slurmd; do
    if running "$DIR/$name.pid"; then echo "${name#munge/}: running (pid $(cat "$DIR/$name.pid"))"
    else echo "${name#munge/}: stopped"; all_running=1; fi
  done
  echo "SLURM_CONF=$CONF"
  if running "$DIR/slurmctld.pid"; then SLURM_CONF="$CONF" sinfo -N -l || true; fi
  return "$all_running"
}

case "${1:-}" in
  install) install ;;
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 install|start|stop|status" >&2; exit 64 ;;
esac

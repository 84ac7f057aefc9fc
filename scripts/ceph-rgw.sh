#!/usr/bin/env bash
# A throw-away single-node Ceph serving the S3 API on loopback, for the tests of the store
# on S3 (crates/s3store, crates/cli/tests/s3_store.rs): one monitor, one BlueStore OSD on a
# sparse file, one radosgw, from Debian's ceph packages (installed here if missing). No
# manager (RADOS and the gateway work without one; it would cost about 300 MiB and a
# larger install), no containers, systemd or LVM.
#
#   scripts/ceph-rgw.sh up     build a fresh cluster, make an S3 user with random keys and
#                              a bucket, write the env file (mode 0600) and print its path
#                              as the only line on stdout (progress goes to stderr)
#   scripts/ceph-rgw.sh down   stop the daemons (SIGKILL, by the pids in their pid files,
#                              each checked to be this cluster's) and delete the cluster
#   scripts/ceph-rgw.sh start  restart the daemons of a stopped cluster on its data
#   scripts/ceph-rgw.sh stop   stop the daemons gracefully (SIGTERM), keep the data
#
# The env file holds AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
# AWS_REGION, AWS_ALLOW_HTTP and KOCHAB_S3_BUCKET, as `export NAME=VALUE` lines: `kochab
# ... --store s3://BUCKET/PREFIX --store-env FILE` reads it, and so do the tests through
# KOCHAB_S3_ENV=FILE. KOCHAB_S3_TESTS=0 makes `up` do nothing (and print nothing).
#
# Knobs: KOCHAB_RGW_DIR (default /tmp/kochab-rgw), KOCHAB_RGW_PORT (S3, default 17480),
# KOCHAB_RGW_MON_PORT (default 13300), KOCHAB_RGW_OSD_PORTS (default 16800-16899). They
# are not Ceph's default ports so that this cluster and another on the machine (one
# started by hand for benchmarks, say) do not collide. KOCHAB_RGW_ADDR (default
# 127.0.0.1): the IPv4 address every daemon binds and the env file names, e.g. a network
# namespace's own address when Ceph is a host of its own in a test (`start` takes it from
# the cluster's ceph.conf).
set -euo pipefail

D=${KOCHAB_RGW_DIR:-/tmp/kochab-rgw}
CONF=$D/ceph.conf
RGW_PORT=${KOCHAB_RGW_PORT:-17480}
MON_PORT=${KOCHAB_RGW_MON_PORT:-13300}
ADDR=${KOCHAB_RGW_ADDR:-127.0.0.1}
OSD_PORTS=${KOCHAB_RGW_OSD_PORTS:-16800-16899}
BUCKET=kochab-test
# Ceph's daemons, in start order.
DAEMONS=(mon.a osd.0 client.rgw.gw)
PKGS=(ceph-mon ceph-osd radosgw ceph-common curl)

log() { echo "ceph-rgw: $*" >&2; }
die() { log "$*"; exit 1; }
now_ms() { echo $(($(date +%s%N) / 1000000)); }

# wait_for SECONDS WHAT COMMAND...: polls COMMAND until it succeeds.
wait_for() {
  local end=$(($(date +%s) + $1)) what=$2
  shift 2
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$end" ] || die "timed out waiting for $what (logs in $D/log)"
    sleep 0.1
  done
}

C() { ceph -c "$CONF" --connect-timeout 15 "$@"; }

install_packages() {
  local missing=() p
  for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  ((${#missing[@]})) || return 0
  [ "$(id -u)" -eq 0 ] || die "need root to install: ${missing[*]}"
  log "installing ${missing[*]}"
  local t0
  t0=$(now_ms)
  export DEBIAN_FRONTEND=noninteractive
  local apt=(apt-get -o DPkg::Lock::Timeout=600 -y -q --no-install-recommends)
  "${apt[@]}" install "${missing[@]}" >/dev/null 2>&1 || {
    apt-get -o DPkg::Lock::Timeout=600 update -q >/dev/null
    "${apt[@]}" install "${missing[@]}" >/dev/null
  }
  log "installed in $(($(now_ms) - t0)) ms"
}

# Is pid $1 a live daemon of this cluster? (The pid file may name a reused pid.)
ours() {
  [ -r "/proc/$1/cmdline" ] && tr '\0' ' ' <"/proc/$1/cmdline" | grep -q -- "$CONF"
}

stop_daemons() { # stop_daemons SIGNAL
  local i name pf pid
  for ((i = ${#DAEMONS[@]} - 1; i >= 0; i--)); do
    name=${DAEMONS[i]}
    pf=$D/run/$name.pid
    [ -f "$pf" ] || continue
    pid=$(cat "$pf")
    if ours "$pid"; then
      kill "-$1" "$pid" 2>/dev/null || true
      for _ in $(seq 1 300); do ours "$pid" || break; sleep 0.05; done
      if ours "$pid"; then
        log "$name ($pid) outlived SIG$1; killing it"
        kill -KILL "$pid" 2>/dev/null || true
      fi
    fi
    rm -f "$pf"
  done
}

start_daemons() {
  running() { [ -f "$D/run/$1.pid" ] && ours "$(cat "$D/run/$1.pid")"; }
  running mon.a || ceph-mon -c "$CONF" -i a </dev/null >>"$D/log/mon.a.out" 2>&1
  wait_for 60 "the monitor" C mon stat
  running osd.0 || ceph-osd -c "$CONF" -i 0 </dev/null >>"$D/log/osd.0.out" 2>&1
  wait_for 90 "osd.0 up" sh -c "ceph -c '$CONF' osd stat -f json | grep -q '\"num_up_osds\":1'"
  running client.rgw.gw || radosgw -c "$CONF" -n client.rgw.gw </dev/null >>"$D/log/rgw.out" 2>&1
  wait_for 120 "radosgw on $ADDR:$RGW_PORT" curl -sf -o /dev/null "http://$ADDR:$RGW_PORT/"
}

write_conf() {
  local fsid=$1
  cat >"$CONF" <<CONF
[global]
fsid = $fsid
mon_host = [v2:$ADDR:$MON_PORT]
public_addr = $ADDR
cluster_addr = $ADDR
ms_bind_ipv4 = true
ms_bind_ipv6 = false
ms_bind_msgr1 = false
ms_bind_port_min = ${OSD_PORTS%-*}
ms_bind_port_max = ${OSD_PORTS#*-}
auth_cluster_required = cephx
auth_service_required = cephx
auth_client_required = cephx
auth_allow_insecure_global_id_reclaim = false
run_dir = $D/run
crash_dir = $D/crash
keyring = $D/\$name/keyring
log_file = $D/log/\$name.log
admin_socket = $D/run/\$name.asok
pid_file = $D/run/\$name.pid
# One OSD: pools of one replica, few placement groups, no autoscaler, no warnings about
# the missing redundancy or the missing manager.
osd_pool_default_size = 1
osd_pool_default_min_size = 1
osd_pool_default_pg_num = 8
osd_pool_default_pgp_num = 8
osd_pool_default_pg_autoscale_mode = off
osd_crush_chooseleaf_type = 0
mon_allow_pool_size_one = true
mon_allow_pool_delete = true
mon_warn_on_pool_no_redundancy = false
mon_max_pg_per_osd = 1000
# Build machines are often more than 70% full: the monitor would warn at 30% free and stop
# at 5%.
mon_data_avail_warn = 2
mon_data_avail_crit = 1

[client.admin]
keyring = $D/ceph.client.admin.keyring

[mon]
mon_data = $D/\$name
mon_initial_members = a
mon_cluster_log_file = $D/log/cluster.log
# One monitor has nothing to batch: propose map changes at once (default every second).
paxos_propose_interval = 0.1
paxos_min_wait = 0.01

[osd]
osd_data = $D/\$name
osd_objectstore = bluestore
# BlueStore on a sparse regular file (made by --mkfs): writes are fdatasynced before
# they are acknowledged, as on a real disk.
bluestore_block_create = true
bluestore_block_size = 10G
bluestore_fsck_on_mkfs = false
# The smallest memory target the OSD accepts, with small fixed caches.
osd_memory_target = 939524096
bluestore_cache_autotune = false
bluestore_cache_size = 67108864

[client.rgw.gw]
rgw_data = $D/\$name
# Without tcp_nodelay, every answer with a body (GET, LIST, multi-object DELETE) waits
# 40 ms for the client's delayed ACK (Nagle's algorithm): measured, GET p50 44 ms.
rgw_frontends = beast endpoint=$ADDR:$RGW_PORT tcp_nodelay=1
rgw_thread_pool_size = 64
CONF
}

up() {
  if [ "${KOCHAB_S3_TESTS:-1}" = 0 ]; then
    log "KOCHAB_S3_TESTS=0: not starting Ceph"
    return 0
  fi
  install_packages
  local b
  for b in ceph ceph-authtool monmaptool ceph-mon ceph-osd radosgw radosgw-admin curl; do
    command -v "$b" >/dev/null || die "$b not found after installing ${PKGS[*]}"
  done
  [ ! -f "$CONF" ] || stop_daemons KILL
  local port
  for port in "$MON_PORT" "$RGW_PORT"; do
    if (exec 3<>"/dev/tcp/$ADDR/$port") 2>/dev/null; then
      die "$ADDR:$port is in use (another Ceph?); see KOCHAB_RGW_*PORT* in $0"
    fi
  done
  rm -rf "$D"
  mkdir -p "$D"/{log,run,crash,osd.0,client.rgw.gw}
  chmod 700 "$D"
  trap 'rc=$?; if [ $rc -ne 0 ]; then log "failed (rc=$rc); logs in $D/log"; stop_daemons KILL; fi' EXIT
  local t0 fsid osd_uuid osd_secret id access secret
  t0=$(now_ms)
  fsid=$(cat /proc/sys/kernel/random/uuid)
  write_conf "$fsid"

  ceph-authtool --create-keyring "$D/mon.keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
  ceph-authtool --create-keyring "$D/ceph.client.admin.keyring" --gen-key -n client.admin \
    --cap mon 'allow *' --cap osd 'allow *' --cap mgr 'allow *' >/dev/null
  ceph-authtool "$D/mon.keyring" --import-keyring "$D/ceph.client.admin.keyring" >/dev/null
  monmaptool --create --fsid "$fsid" --addv a "[v2:$ADDR:$MON_PORT]" "$D/monmap" >/dev/null
  ceph-mon -c "$CONF" --mkfs -i a --monmap "$D/monmap" --keyring "$D/mon.keyring" 2>>"$D/log/mkfs.out"
  rm -f "$D/mon.keyring"
  ceph-mon -c "$CONF" -i a </dev/null >>"$D/log/mon.a.out" 2>&1
  wait_for 60 "the monitor" C mon stat

  osd_uuid=$(cat /proc/sys/kernel/random/uuid)
  osd_secret=$(ceph-authtool --gen-print-key)
  id=$(echo "{\"cephx_secret\": \"$osd_secret\"}" | C osd new "$osd_uuid" -i -)
  [ "$id" = 0 ] || die "the new OSD got id '$id', not 0"
  ceph-authtool --create-keyring "$D/osd.0/keyring" --name osd.0 --add-key "$osd_secret" >/dev/null
  ceph-osd -c "$CONF" -i 0 --mkfs --osd-uuid "$osd_uuid" >>"$D/log/mkfs.out" 2>&1 ||
    { tail -20 "$D/log/mkfs.out" >&2; die "ceph-osd --mkfs failed"; }
  C auth get-or-create client.rgw.gw mon 'allow rw' osd 'allow rwx' -o "$D/client.rgw.gw/keyring"
  start_daemons

  # Keys of the test user: random, in the env file only (never on a command line a test
  # could print; radosgw-admin takes them as arguments, which is this script's alone).
  access=$(od -An -N10 -tx1 /dev/urandom | tr -d ' \n' | tr a-f A-F)
  secret=$(od -An -N20 -tx1 /dev/urandom | tr -d ' \n')
  radosgw-admin -c "$CONF" user create --uid=kochab --display-name="kochab tests" \
    --access-key="$access" --secret-key="$secret" >"$D/user.json"
  chmod 600 "$D/user.json"
  # (curl signs no payload hash by itself; S3 wants one, here that of the empty body.)
  curl -sf --aws-sigv4 "aws:amz:us-east-1:s3" --user "$access:$secret" -X PUT \
    -H "x-amz-content-sha256: e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855" \
    "http://$ADDR:$RGW_PORT/$BUCKET" -o /dev/null ||
    die "cannot create bucket $BUCKET"
  (
    umask 077
    cat >"$D/env" <<ENV
export AWS_ENDPOINT_URL=http://$ADDR:$RGW_PORT
export AWS_ACCESS_KEY_ID=$access
export AWS_SECRET_ACCESS_KEY=$secret
export AWS_REGION=us-east-1
export AWS_ALLOW_HTTP=true
export KOCHAB_S3_BUCKET=$BUCKET
ENV
  )
  trap - EXIT
  log "ready in $(($(now_ms) - t0)) ms: S3 at http://$ADDR:$RGW_PORT, bucket $BUCKET"
  echo "$D/env"
}

case "${1:-}" in
  up) up ;;
  down)
    stop_daemons KILL
    rm -rf "$D"
    ;;
  start)
    [ -f "$CONF" ] || die "no cluster in $D (run: $0 up)"
    ADDR=$(sed -n 's/^public_addr = \(.*\)$/\1/p' "$CONF")
    RGW_PORT=$(sed -n 's/^rgw_frontends = beast endpoint=[^ ]*:\([0-9]*\) .*$/\1/p' "$CONF")
    t0=$(now_ms)
    start_daemons
    log "restarted in $(($(now_ms) - t0)) ms"
    ;;
  stop) stop_daemons TERM ;;
  *)
    echo "usage: $0 up|down|start|stop" >&2
    exit 2
    ;;
esac

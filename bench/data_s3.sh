#!/usr/bin/env bash
# File data on S3 (issue 31): what the object store does by itself from one client, against
# file data through a Kochab mount on the same store, in one run, and how many of the file's
# bytes the metadata server moved.
#
# Per round:
#  1. `kochab store bench --parallel PARALLEL --size OBJ --total DD_MB MiB`: conditional PUTs,
#     then GETs, of fresh objects through Kochab's own store client (deleted after);
#  2. through a mount (`kochab up --store s3://...` as one process, `kochab mount` as
#     another, so that the server's process moves no byte of the mount's own FUSE traffic):
#     dd bs=1M count=DD_MB conv=fsync (write), then unmount, drop caches, mount again and
#     dd the file back (cold read); then dd bs=4k of DD4K_MB MiB with conv=fsync;
#  3. around each dd, the server process's /proc/PID/io (rchar, wchar, read_bytes,
#     write_bytes) and its TCP bytes: `ss -tinp` bytes_received and bytes_sent of each of
#     its sockets, split into its clients' connections (the mount) and the store's
#     (connections to the RGW endpoint). rchar/wchar alone cannot tell: they count read(2)
#     and write(2)/writev(2) on sockets but not recv(2)/send(2), which is what Rust's
#     sockets use to read (measured here: 50 MB through recv() added 108 bytes to rchar),
#     so a server that moves every byte can show rchar near 0. The TCP figures are the
#     share reported; sockets that close during a dd (none expected: both HTTP pools keep
#     idle connections for far longer than a run) are counted and printed.
# Medians over ROUNDS; every run printed.
#
# Usage: bench/data_s3.sh [ROUNDS]     (default 3; needs root: FUSE, drop_caches, ss -p)
# Env:   KOCHAB_S3_ENV   env file of a running RGW (`scripts/ceph-rgw.sh up` prints it);
#                        without it this script starts one with scripts/ceph-rgw.sh (its
#                        KOCHAB_RGW_* variables apply; default dir /tmp/kochab-rgw-data) and
#                        stops it at the end
#        KOCHAB_BIN (target/release/kochab), PORT (17790), PARALLEL (16), OBJ (1MiB),
#        DD_MB (1024), DD4K_MB (256), DD_SRC (/dev/zero; "random": a file of random bytes
#        made once, read from the page cache), JSON=1 (also print the summary as JSON)
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
BIN=${KOCHAB_BIN:-target/release/kochab}
PORT=${PORT:-17790}
PARALLEL=${PARALLEL:-16}
OBJ=${OBJ:-1MiB}
DD_MB=${DD_MB:-1024}
DD4K_MB=${DD4K_MB:-256}
DD_SRC=${DD_SRC:-/dev/zero}

[ "$(id -u)" = 0 ] || { echo "needs root (FUSE, drop_caches, ss -p)" >&2; exit 1; }
[ -x "$BIN" ] || { echo "no $BIN: cargo build --release --locked -p kochab" >&2; exit 1; }
command -v ss >/dev/null || { echo "needs ss (iproute2)" >&2; exit 1; }

tmp=$(mktemp -d /var/tmp/kochab-data-s3.XXXXXX)
MNT=/mnt/kds3.$$
SERVER=
MOUNT_PID=
OWN_RGW=0
log() { echo "[$(date +%H:%M:%S)] $*" >&2; }
is_mounted() { awk -v m="$1" '$2==m {f=1} END {exit !f}' /proc/mounts; }
stop_pid() { # stop_pid PID: SIGTERM, then SIGKILL after 30 s
  local p=$1
  kill -0 "$p" 2>/dev/null || return 0
  kill -TERM "$p"
  for _ in $(seq 150); do kill -0 "$p" 2>/dev/null || return 0; sleep 0.2; done
  log "$p did not stop within 30 s of SIGTERM: SIGKILL"
  kill -KILL "$p" 2>/dev/null || true
}
unmount() {
  if is_mounted "$MNT"; then fusermount3 -u "$MNT" 2>/dev/null || umount "$MNT" || umount -l "$MNT"; fi
  if [ -n "$MOUNT_PID" ]; then stop_pid "$MOUNT_PID"; wait "$MOUNT_PID" 2>/dev/null || true; MOUNT_PID=; fi
}
cleanup() {
  set +e
  unmount
  [ -n "$SERVER" ] && stop_pid "$SERVER"
  is_mounted "$MNT" || rmdir "$MNT" 2>/dev/null
  [ "$OWN_RGW" = 1 ] && scripts/ceph-rgw.sh down >/dev/null 2>&1
  is_mounted "$MNT" || rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if [ -z "${KOCHAB_S3_ENV:-}" ]; then
  export KOCHAB_RGW_DIR=${KOCHAB_RGW_DIR:-/tmp/kochab-rgw-data}
  log "starting Ceph RGW in $KOCHAB_RGW_DIR"
  OWN_RGW=1
  KOCHAB_S3_ENV=$(scripts/ceph-rgw.sh up)
fi
ENDPOINT=$(sed -n 's/^export AWS_ENDPOINT_URL=//p' "$KOCHAB_S3_ENV")
BUCKET=$(sed -n 's/^export KOCHAB_S3_BUCKET=//p' "$KOCHAB_S3_ENV")
RGW_HOSTPORT=${ENDPOINT#*://}
RGW_HOSTPORT=${RGW_HOSTPORT%%/*}
RGW_CONF=$(dirname "$KOCHAB_S3_ENV")/ceph.conf
PREFIX=data-s3/$(date +%s)-$$
cp "$BIN" "$tmp/kochab"   # a rebuild during the run must not change the binary
BIN=$tmp/kochab

SRC=$DD_SRC
if [ "$DD_SRC" = random ]; then
  SRC=$tmp/random
  head -c $((DD_MB << 20)) /dev/urandom >"$SRC"
fi

drop_caches() { sync; echo 3 >/proc/sys/vm/drop_caches; }

# RGW keeps deleted objects' space until its garbage collection (hours by default): on a
# cluster of this script's or of scripts/ceph-rgw.sh's, run it between rounds so that a
# small test cluster does not fill up.
rgw_gc() {
  if [ -f "$RGW_CONF" ] && command -v radosgw-admin >/dev/null; then
    timeout 300 radosgw-admin -c "$RGW_CONF" gc process --include-all >/dev/null 2>&1 || true
  fi
}

# io_snap PID FILE: the process's /proc/PID/io counters and its sockets' TCP byte counters.
# FILE gets "io rchar wchar read_bytes write_bytes" and one "sock KIND LOCAL PEER SENT
# RECEIVED" line per TCP socket of the process (KIND: store if PEER is the RGW endpoint,
# else client).
io_snap() {
  local pid=$1 out=$2
  awk -F': *' '{v[$1]=$2} END {print "io", v["rchar"], v["wchar"], v["read_bytes"], v["write_bytes"]}' \
    "/proc/$pid/io" >"$out"
  ss -tinpH state established 2>/dev/null | awk -v pid="pid=$pid," -v rgw="$RGW_HOSTPORT" '
    /^[^ \t]/ { mine = index($0, pid) > 0; local_ = $3; peer = $4; next }
    mine {
      sent = 0; recv = 0
      for (i = 1; i <= NF; i++) {
        if ($i ~ /^bytes_sent:/) { sub(/^bytes_sent:/, "", $i); sent = $i }
        if ($i ~ /^bytes_received:/) { sub(/^bytes_received:/, "", $i); recv = $i }
      }
      print "sock", (peer == rgw ? "store" : "client"), local_, peer, sent, recv
      mine = 0
    }' >>"$out"
}

# io_delta BEFORE AFTER: "rchar wchar read_bytes write_bytes client_in client_out store_in
# store_out closed" between two snapshots (a socket absent before counts from 0; one
# present before and gone after is counted in `closed`, its bytes since unknown).
io_delta() {
  awk '
    FNR == 1 { f++ }
    $1 == "io" { for (i = 2; i <= 5; i++) io[f, i] = $i; next }
    $1 == "sock" { k = $3 " " $4; kind[k] = $2; s[f, k] = $5; r[f, k] = $6; seen[f, k] = 1 }
    END {
      for (key in kind) {
        if (!seen[2, key]) { if (seen[1, key]) closed++; continue }
        ds = s[2, key] - (seen[1, key] ? s[1, key] : 0)
        dr = r[2, key] - (seen[1, key] ? r[1, key] : 0)
        if (kind[key] == "store") { stin += dr; stout += ds } else { cin += dr; cout += ds }
      }
      printf "%d %d %d %d %d %d %d %d %d\n", io[2,2]-io[1,2], io[2,3]-io[1,3], io[2,4]-io[1,4], \
        io[2,5]-io[1,5], cin, cout, stin, stout, closed
    }' "$1" "$2"
}

# dd_rate: MB/s (10^6 bytes) from dd's summary line on stdin.
dd_rate() {
  awk '/copied/ { n = $1; for (i = 1; i <= NF; i++) if ($i == "s," || $i == "s") t = $(i-1); \
    if (t > 0) printf "%.1f\n", n / t / 1e6 }'
}

start_server() {
  "$BIN" up --data "$tmp/data" --port "$PORT" --store "s3://$BUCKET/$PREFIX" \
    --store-env "$KOCHAB_S3_ENV" >"$tmp/server.out" 2>"$tmp/server.err" &
  SERVER=$!
  for _ in $(seq 600); do
    grep -q "cluster ready" "$tmp/server.out" 2>/dev/null && break
    kill -0 "$SERVER" 2>/dev/null || break
    sleep 0.1
  done
  grep -q "cluster ready" "$tmp/server.out" || { cat "$tmp/server.err" >&2; exit 1; }
  log "server (pid $SERVER) on s3://$BUCKET/$PREFIX at $ENDPOINT: $(cat "$tmp/server.out")"
}

mount_fs() {
  mkdir -p "$MNT"
  ! is_mounted "$MNT" || { echo "$MNT already mounted" >&2; exit 1; }
  "$BIN" mount "127.0.0.1:$PORT" "$MNT" --key-file "$tmp/data/cluster.key" --foreground \
    >>"$tmp/mount.out" 2>&1 &
  MOUNT_PID=$!
  for _ in $(seq 300); do
    is_mounted "$MNT" && return 0
    kill -0 "$MOUNT_PID" 2>/dev/null || break
    sleep 0.1
  done
  cat "$tmp/mount.out" >&2
  exit 1
}

RAW=$tmp/raw
: >"$RAW"
# record NAME VALUE: one figure of one round.
record() { echo "$1 $2" >>"$RAW"; }

# measured_dd NAME FILE_BYTES DD-ARGS...: runs dd with the server's counters around it,
# prints the run's line and records its figures.
measured_dd() {
  local name=$1 bytes=$2 rate d
  shift 2
  io_snap "$SERVER" "$tmp/before"
  rate=$(timeout -k 10 900 dd "$@" 2>&1 | dd_rate)
  io_snap "$SERVER" "$tmp/after"
  d=($(io_delta "$tmp/before" "$tmp/after"))
  record "$name.mb_s" "${rate:-0}"
  record "$name.server_tcp_pct" "$(awk -v a="${d[4]}" -v b="${d[5]}" -v c="${d[6]}" -v e="${d[7]}" -v f="$bytes" \
    'BEGIN { m = a; if (b > m) m = b; if (c > m) m = c; if (e > m) m = e; printf "%.2f", 100 * m / f }')"
  record "$name.rchar_wchar_pct" "$(awk -v a="${d[0]}" -v b="${d[1]}" -v f="$bytes" 'BEGIN { m = a > b ? a : b; printf "%.2f", 100 * m / f }')"
  echo "round $round $name: ${rate:-failed} MB/s; server process: from clients ${d[4]} B, to clients ${d[5]} B, from store ${d[6]} B, to store ${d[7]} B (file $bytes B); /proc io rchar ${d[0]} wchar ${d[1]} read_bytes ${d[2]} write_bytes ${d[3]}; sockets closed meanwhile ${d[8]}"
}

echo "$(date -u +%FT%TZ) $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg); store $ENDPOINT s3://$BUCKET/$PREFIX; $ROUNDS rounds; dd source $DD_SRC"
start_server
mount_fs
for round in $(seq "$ROUNDS"); do
  # 1. The store by itself.
  j=$("$BIN" store bench --store "s3://$BUCKET/$PREFIX-bench-$round" --store-env "$KOCHAB_S3_ENV" \
    --parallel "$PARALLEL" --size "$OBJ" --total "${DD_MB}MiB" --json 2>"$tmp/bench.err") \
    || { cat "$tmp/bench.err" >&2; exit 1; }
  put=$(echo "$j" | python3 -c 'import json,sys; print("%.1f" % json.load(sys.stdin)["put"]["mb_per_s"])')
  get=$(echo "$j" | python3 -c 'import json,sys; print("%.1f" % json.load(sys.stdin)["get"]["mb_per_s"])')
  record store_put.mb_s "$put"
  record store_get.mb_s "$get"
  echo "round $round store by itself ($PARALLEL x $OBJ): PUT $put MB/s, GET $get MB/s"

  # 2. Through the mount.
  f=$MNT/data-s3-$round
  drop_caches
  measured_dd write_1m $((DD_MB << 20)) if="$SRC" of="$f" bs=1M count="$DD_MB" conv=fsync
  unmount; drop_caches; mount_fs
  measured_dd read_1m $((DD_MB << 20)) if="$f" of=/dev/null bs=1M
  rm -f "$f"
  drop_caches
  measured_dd write_4k $((DD4K_MB << 20)) if="$SRC" of="$f.4k" bs=4k count=$((DD4K_MB * 256)) conv=fsync
  rm -f "$f.4k"
  rgw_gc
done

# Summary: the median of each figure over the rounds, one line each.
median() { sort -g | awk '{v[NR] = $1} END {if (NR % 2) print v[(NR + 1) / 2]; else printf "%.2f\n", (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
echo "summary (medians of $ROUNDS rounds):"
for k in store_put.mb_s store_get.mb_s write_1m.mb_s read_1m.mb_s write_4k.mb_s \
  write_1m.server_tcp_pct read_1m.server_tcp_pct write_4k.server_tcp_pct \
  write_1m.rchar_wchar_pct read_1m.rchar_wchar_pct write_4k.rchar_wchar_pct; do
  v=$(awk -v k="$k" '$1 == k {print $2}' "$RAW" | median)
  printf "  %-28s %s\n" "$k" "$v"
  echo "$k $v" >>"$tmp/summary"
done
sp=$(awk '$1 == "store_put.mb_s" {print $2}' "$tmp/summary")
sg=$(awk '$1 == "store_get.mb_s" {print $2}' "$tmp/summary")
w1=$(awk '$1 == "write_1m.mb_s" {print $2}' "$tmp/summary")
r1=$(awk '$1 == "read_1m.mb_s" {print $2}' "$tmp/summary")
w4=$(awk '$1 == "write_4k.mb_s" {print $2}' "$tmp/summary")
awk -v sp="$sp" -v sg="$sg" -v w1="$w1" -v r1="$r1" -v w4="$w4" 'BEGIN {
  printf "  %-28s %.2f (issue 31 asks >= 0.8)\n", "write_1m / store_put", (sp > 0 ? w1 / sp : 0)
  printf "  %-28s %.2f (issue 31 asks >= 0.8)\n", "read_1m / store_get", (sg > 0 ? r1 / sg : 0)
  printf "  %-28s %.2f (issue 31 asks >= 0.8)\n", "write_4k / write_1m", (w1 > 0 ? w4 / w1 : 0)
}'
echo "  (server_tcp_pct: the largest of the server's TCP bytes from/to clients and from/to the store, as % of the file's bytes; issue 31 asks < 1)"
if [ "${JSON:-0}" = 1 ]; then
  awk 'BEGIN {printf "{"} {printf "%s\"%s\": %s", (NR > 1 ? ", " : ""), $1, $2} END {print "}"}' "$tmp/summary"
fi

#!/usr/bin/env bash
# A cold `find` through a mount: what it costs at the servers and in CPU.
# Per binary: a fresh cluster, two `tar -x` of the kernel tree of empty files (the one
# bench/fuse_compare.sh builds, KTREE), drop caches, two `find`s at once; prints the find's
# time and rate, the CPU of the server and mount processes over it, and the server
# requests it made (kochab_operations_total, by op).
# SEPARATE=1: the server (`kochab up`) and the mount (`kochab mount`) in two processes,
# talking over loopback TCP as a mount on another machine would; otherwise one
# `kochab up --mount` (the mount's requests reach the server in the same process).
# Usage: bench/find_walk.sh [KOCHAB_BIN...]   (root; default target/release/kochab)
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "needs root" >&2; exit 1; }
PORT=${PORT:-7483}
MPORT=${MPORT:-7484}
SEPARATE=${SEPARATE:-0}
KTREE=${KTREE:-/var/tmp/kochab-ktree.tar}
[ -s "$KTREE" ] || { echo "no $KTREE: run WORKLOADS=tarfind bench/fuse_compare.sh once" >&2; exit 1; }
entries=$(tar -tf "$KTREE" | wc -l)
tmp=$(mktemp -d /var/tmp/kfind.XXXXXX)
m=$tmp/m
pids=()
stop() {
  fusermount3 -u "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
  for p in "${pids[@]}"; do kill -INT "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  pids=()
}
trap 'stop; rm -rf "$tmp"' EXIT
ops() {  # server requests by op, "op count" lines
  curl -s "localhost:$MPORT/metrics" |
    sed -n 's/^kochab_operations_total{op="\([a-z_]*\)",result="ok"} \([0-9]*\)$/\1 \2/p' | sort
}
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
for bin in "${@:-target/release/kochab}"; do
  rm -rf "$tmp/data" "$m"; mkdir -p "$m"
  "$bin" up --data "$tmp/data" --port "$PORT" --metrics-port "$MPORT" \
    $([ "$SEPARATE" = 1 ] || echo --mount "$m") >"$tmp/log" 2>&1 &
  pids=($!)
  if [ "$SEPARATE" = 1 ]; then
    for _ in $(seq 100); do [ -s "$tmp/data/cluster.key" ] && break; sleep 0.1; done
    sleep 0.5
    "$bin" mount "127.0.0.1:$PORT" "$m" --foreground --key-file "$tmp/data/cluster.key" \
      >"$tmp/mount.log" 2>&1 &
    pids+=($!)
  fi
  for _ in $(seq 200); do grep -qs " $m " /proc/mounts && break; sleep 0.1; done
  tars=()
  for i in 1 2; do
    mkdir "$m/t$i"; tar -xf "$KTREE" -C "$m/t$i" & tars+=($!)
  done
  wait "${tars[@]}"
  sync; echo 3 >/proc/sys/vm/drop_caches
  before=$(ops); c0=(); for p in "${pids[@]}"; do c0+=("$(ticks "$p")"); done
  t0=$(date +%s.%N)
  finds=()
  for i in 1 2; do find "$m/t$i" >/dev/null & finds+=($!); done
  wait "${finds[@]}"
  t1=$(date +%s.%N)
  after=$(ops); cpu=""
  for i in "${!pids[@]}"; do
    cpu+=" $(( ($(ticks "${pids[$i]}") - ${c0[$i]}) * 1000 / $(getconf CLK_TCK) ))ms"
  done
  echo "$bin separate=$SEPARATE find_s=$(echo "$t1 - $t0" | bc)" \
    "entries_per_s=$(echo "2 * $entries / ($t1 - $t0)" | bc) cpu(server[,mount])=${cpu# }"
  join <(echo "$before") <(echo "$after") | awk '$3 > $2 {printf "  %s %d\n", $1, $3 - $2}'
  stop
done

#!/usr/bin/env bash
# Many processes waiting for one fcntl lock through a fresh `kochab up --mount`: for each
# count in COUNTS, bench/lock_waiters.c with every process pinned to CPU 0 (all their FUSE
# requests then go to one io_uring queue, which starts with 64 entries) and then unpinned;
# how long after the holder's unlock every waiter has had the lock. A run that does not end
# within LIMIT seconds is reported as stalled.
# Usage: bench/lock_waiters.sh [KOCHAB_BIN...]   (root; default target/release/kochab)
# Env:   COUNTS="10 100 300" LIMIT=60 PORT=7495
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "needs root" >&2; exit 1; }
COUNTS=${COUNTS:-10 100 300}
LIMIT=${LIMIT:-60}
PORT=${PORT:-7495}
tmp=$(mktemp -d /var/tmp/klock.XXXXXX)
pid=
cleanup() {
  [ -n "$pid" ] && kill -INT "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
  grep -qs " $tmp/m " /proc/mounts && umount -l "$tmp/m"
  rm -rf "$tmp"
}
trap cleanup EXIT
gcc -O2 -Wall -o "$tmp/lock_waiters" bench/lock_waiters.c
# A fresh cluster per run: waiters of a stalled run stay blocked until their mount ends.
for bin in "${@:-target/release/kochab}"; do
  for n in $COUNTS; do
    for pin in "taskset -c 0" ""; do
      rm -rf "$tmp/data"; mkdir -p "$tmp/m"
      "$bin" up --data "$tmp/data" --port "$PORT" --mount "$tmp/m" >"$tmp/log" 2>&1 &
      pid=$!
      for _ in $(seq 200); do grep -qs " $tmp/m " /proc/mounts && break; sleep 0.1; done
      out=$(timeout "$LIMIT" $pin "$tmp/lock_waiters" "$tmp/m/lock" "$n" || echo "stalled (no end within $LIMIT s)")
      echo "$bin ${pin:+pinned to CPU 0 }$out"
      kill -INT "$pid"; wait "$pid" 2>/dev/null || true; pid=
      grep -qs " $tmp/m " /proc/mounts && umount -l "$tmp/m"
    done
  done
done

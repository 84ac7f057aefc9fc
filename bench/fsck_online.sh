#!/usr/bin/env bash
# kochab fsck of a running 2-server cluster holding ITEMS files, every 10th renamed into
# the next client's directory (names that cross servers); three fsck runs, timed.
# Usage: [ITEMS=n] [PORT=p] [BIN=path] bench/fsck_online.sh
set -euo pipefail
BIN=${BIN:-$(dirname "$0")/../target/release/kochab}; PORT=${PORT:-7960}; ITEMS=${ITEMS:-1000000}
tmp=$(mktemp -d); source "$(dirname "$0")/cluster_lib.sh"
trap cluster_cleanup EXIT
d=$tmp/data
cluster_up "$d" 2
cluster_wait_spread "$d" 2
"$BIN" bench --cluster 127.0.0.1:$PORT --key-file "$d/cluster.key" --items "$ITEMS" --clients 64 \
  --top-level --cross-every 10 --phases create --json
for i in 1 2 3; do
  /usr/bin/time -f "fsck wall %e s, user %U s, sys %S s, maxrss %M KB" \
    "$BIN" fsck --cluster 127.0.0.1:$PORT --key-file "$d/cluster.key" 2>&1 | tail -6
done
"$BIN" status --cluster 127.0.0.1:$PORT --key-file "$d/cluster.key" 2>/dev/null | head -5 || true
cluster_down

#!/usr/bin/env bash
# Multi-server penalty, Ursa Minor Fig. 4 style: `kochab bench` creates files, each client
# in its own top-level directory, on a cluster of 2 metadata server processes whose tables
# are spread so that neighbouring clients' directories are on different servers; every
# Nth file is also renamed into the next client's directory (a multi-server operation,
# run by BORROW/RETURN, or with --mode txn as a two-phase commit between the two servers,
# see docs/TRANSACTIONS.md). F = measured fraction of multi-server operations; slowdown is
# against F = 0 of the same mode, medians of ROUNDS fresh clusters per point.
#
# Usage: bench/multiserver.sh [--json] [--mode borrow|txn|auto] [ROUNDS]
# Env: CLIENTS (16), ITEMS (60000), EVERY ("0 1667 400 100 50"), KOCHAB_BIN, PORT (7700).
set -euo pipefail
cd "$(dirname "$0")/.."
JSON=0
MODE=borrow
while [ $# -gt 0 ]; do
  case "$1" in
    --json) JSON=1; shift ;;
    --mode) MODE=$2; shift 2 ;;
    *) break ;;
  esac
done
case "$MODE" in borrow|txn|auto) ;; *) echo "--mode borrow|txn|auto" >&2; exit 2 ;; esac
UP_ARGS="${UP_ARGS:-} --multi-server $MODE"
ROUNDS=${1:-3}
BIN=${KOCHAB_BIN:-target/release/kochab}
PORT=${PORT:-7700}
CLIENTS=${CLIENTS:-16}
ITEMS=${ITEMS:-60000}
EVERY=${EVERY:-"0 1667 400 100 50"}
tmp=$(mktemp -d /var/tmp/kochab-multi.XXXXXX)
. bench/cluster_lib.sh
cleanup() {
  cluster_cleanup
  [ -n "${KEEP_LOGS:-}" ] && cp "$tmp/log" "$KEEP_LOGS"
  rm -rf "$tmp"
}
trap cleanup EXIT

: >"$tmp/results"
for r in $(seq "$ROUNDS"); do
  for every in $EVERY; do
    d="$tmp/data-$every-$r"
    cluster_up "$d" 2
    cluster_wait_spread "$d" 2
    j=$("$BIN" bench --cluster 127.0.0.1:$PORT --key-file "$d/cluster.key" --clients "$CLIENTS" \
          --items "$ITEMS" --top-level --cross-every "$every" --phases create --json)
    cluster_down
    echo "$every $r $j" >>"$tmp/results"
    [ $JSON = 1 ] || echo "every $every round $r: $j"
    [ -n "${KEEP_LOGS:-}" ] && mkdir -p "$KEEP_LOGS.d/$every-$r" && cp "$d"/logs/* "$KEEP_LOGS.d/$every-$r/"
    rm -rf "$d"
  done
done
python3 - "$tmp/results" "$JSON" "$MODE" <<'PY'
import json, sys, statistics as st
rows = {}
for line in open(sys.argv[1]):
    every, r, rest = line.split(' ', 2)
    c = json.loads(rest)['create']
    rows.setdefault(int(every), []).append(c)
points = []
base = None
for every in sorted(rows, key=lambda e: (e != 0, -e if e else 0)):
    v = rows[every]
    ops = st.median(x['ops_per_sec'] for x in v)
    frac = st.median(x['cross_ops'] / max(1, x['ops']) for x in v)
    if every == 0:
        base = ops
    p = {"every": every, "fraction": frac, "ops_per_sec": ops,
         "slowdown": (1 - ops / base) if base else None,
         "multi_p50_us": st.median(x['cross_p50_us'] for x in v),
         "single_p50_us": st.median(x['local_p50_us'] for x in v),
         "errors": sum(x['errors'] for x in v), "runs": [x['ops_per_sec'] for x in v]}
    points.append(p)
if sys.argv[2] == "1":
    print(json.dumps({"mode": sys.argv[3], "points": points}))
else:
    print(f"mode {sys.argv[3]}")
    print(f"{'F (measured)':>13} {'ops/s':>9} {'slowdown':>9} {'multi p50 us':>13} {'single p50 us':>14} errors")
    for p in points:
        sd = f"{100 * p['slowdown']:.2f}%" if p['slowdown'] is not None else "-"
        print(f"{100 * p['fraction']:>12.3f}% {p['ops_per_sec']:>9.0f} {sd:>9} {p['multi_p50_us']:>13.0f} {p['single_p50_us']:>14.0f} {p['errors']}")
PY

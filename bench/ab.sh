#!/usr/bin/env bash
# A/B comparison of two kochab binaries on this noisy machine: alternates runs of
# `kochab bench` against a fresh server started from each binary, prints every run and the
# median per binary and phase. Usage: bench/ab.sh BIN_A BIN_B [ROUNDS] [bench args...]
set -euo pipefail
A=$1; B=$2; ROUNDS=${3:-3}; shift 3 || true
ARGS=("$@"); [ ${#ARGS[@]} -eq 0 ] && ARGS=(--clients 64 --items 300000)
PORT=${PORT:-7431}
tmp=$(mktemp -d)
trap 'pkill -f " up --data $tmp" || true; rm -rf "$tmp"' EXIT
run() {  # run BIN LABEL
  local bin=$1 label=$2 d="$tmp/$2"
  rm -rf "$d" "$tmp/out"
  "$bin" up --data "$d" --port $PORT >"$tmp/out" 2>"$tmp/err" &
  local pid=$!
  for _ in $(seq 600); do grep -q ready "$tmp/out" 2>/dev/null && break; sleep 0.05; done
  local j; j=$("$bin" bench --cluster 127.0.0.1:$PORT --key-file "$d/cluster.key" --json "${ARGS[@]}")
  kill $pid; wait $pid 2>/dev/null || true
  echo "$label $j"
}
for r in $(seq "$ROUNDS"); do run "$A" A; run "$B" B; done | tee "$tmp/all"
python3 - "$tmp/all" <<'PY'
import json, sys, statistics
rows = {}
for line in open(sys.argv[1]):
    label, j = line.split(' ', 1)
    for phase, r in json.loads(j).items():
        rows.setdefault((phase, label), []).append(r['ops_per_sec'])
for (phase, label), v in sorted(rows.items()):
    print(f"{phase:7} {label}: median {statistics.median(v):9.0f} ops/s  runs {[round(x) for x in v]}")
PY

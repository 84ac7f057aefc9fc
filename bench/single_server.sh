#!/usr/bin/env bash
# The "Must show" figures of the single-server issue, in one run on this machine:
#  1. kochab bench, durable mode, 64 clients, 1,000,000 files: unique directories and one
#     shared directory, ROUNDS rounds each (fresh server per round), medians reported;
#  2. resident memory of the server holding 1,000,000 files (bytes per file);
#  3. restart of that server after SIGKILL, until it serves again.
# Usage: bench/single_server.sh [ROUNDS]   (needs a release build: cargo build --release)
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
BIN=${KOCHAB_BIN:-target/release/kochab}
PORT=${PORT:-7451}
tmp=$(mktemp -d /var/tmp/kochab-bench.XXXXXX)
trap 'pkill -f "up --data $tmp" 2>/dev/null || true; rm -rf "$tmp"' EXIT

start() {  # start DATA -> prints seconds until ready
  local d=$1 t0 t1
  : >"$tmp/out"
  t0=$(date +%s.%N)
  "$BIN" up --data "$d" --port $PORT >"$tmp/out" 2>>"$tmp/log" &
  echo $! >"$tmp/pid"
  until grep -q "cluster ready" "$tmp/out" 2>/dev/null; do sleep 0.01; done
  t1=$(date +%s.%N)
  python3 -c "print(f'{$t1-$t0:.3f}')"
}
gone() { local p; p=$(cat "$tmp/pid"); while kill -0 "$p" 2>/dev/null; do sleep 0.02; done; }
stop() { kill -TERM "$(cat "$tmp/pid")" 2>/dev/null || true; gone; }
kill9() { kill -KILL "$(cat "$tmp/pid")" 2>/dev/null || true; gone; }

: >"$tmp/results"
for r in $(seq "$ROUNDS"); do
  for mode in unique shared; do
    d="$tmp/data-$mode-$r"
    start "$d" >/dev/null
    flag=(); [ $mode = shared ] && flag=(--shared-dir)
    key=(--cluster 127.0.0.1:$PORT --key-file "$d/cluster.key")
    j=$("$BIN" bench "${key[@]}" --clients 64 --items 1000000 "${flag[@]}" --phases create,stat --json)
    rss=$("$BIN" status "${key[@]}" --json | python3 -c 'import json,sys; s=json.load(sys.stdin); print(s["rss_bytes"], s["inodes"])')
    kill9
    restart=$(start "$d")
    jr=$("$BIN" bench "${key[@]}" --clients 64 --items 1000000 "${flag[@]}" --phases remove --json)
    stop
    echo "$mode $r $j $jr $rss $restart" | tee -a "$tmp/results"
    rm -rf "$d"
  done
done
python3 - "$tmp/results" <<'PY'
import json, sys, statistics as st
rows = {}
for line in open(sys.argv[1]):
    mode, r, rest = line.split(' ', 2)
    dec = json.JSONDecoder()
    a, i = dec.raw_decode(rest); rest = rest[i:].strip()
    b, i = dec.raw_decode(rest); rest = rest[i:].split()
    rss, inodes, restart = int(rest[0]), int(rest[1]), float(rest[2])
    d = rows.setdefault(mode, {})
    for ph, v in {**a, **b}.items():
        d.setdefault(ph, []).append(v)
    d.setdefault('bytes_per_file', []).append(rss / inodes)
    d.setdefault('restart_s', []).append(restart)
for mode, d in rows.items():
    print(f"== {mode} directories (64 clients, 1,000,000 files, {len(d['create'])} rounds; medians)")
    for ph in ('create', 'stat', 'remove'):
        v = d[ph]
        print(f"  {ph:7} {st.median(x['ops_per_sec'] for x in v):9.0f} ops/s  p50 {st.median(x['p50_us'] for x in v):6.0f} us  p99 {st.median(x['p99_us'] for x in v):6.0f} us  errors {sum(x['errors'] for x in v)}  runs {[round(x['ops_per_sec']) for x in v]}")
    print(f"  memory  {st.median(d['bytes_per_file']):.0f} bytes per file (RSS / inodes)  runs {[round(x) for x in d['bytes_per_file']]}")
    print(f"  restart {st.median(d['restart_s']):.2f} s after SIGKILL until serving  runs {d['restart_s']}")
PY

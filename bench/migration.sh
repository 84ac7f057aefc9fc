#!/usr/bin/env bash
# Migration under load: a 3-server cluster (`kochab up --servers 3`) runs a bounded
# create/stat/rename load (`kochab bench --churn`: each client in its own top-level
# directory repeats create f<i>, stat f<i>, rename f<i> -> r<i>) while every table is
# moved once with `kochab table move`, one at a time, each waited for. Prints operations
# per second over time with the moves marked, the dip (lowest full second against the
# median), the client-visible errors, and what the bench's check afterwards found lost or
# doubled (every acknowledged create and rename must be there exactly once).
#
# Moves are chosen to keep the table counts even (from the server with most tables to the
# one with fewest), so the balancer has nothing to undo; any table the balancer moved on
# its own in between is counted and shown.
#
# The clients' directories are made first by a one-server cluster holding every table (as
# in bench/scaling.sh), so that they are dealt across tables and servers.
#
# Usage: bench/migration.sh
# Env: KOCHAB_BIN, PORT (7700), CLIENTS (16), SECONDS_LOAD (90), WARMUP (8: seconds of load
#      before the first move), JSON_OUT (file for the bench's raw JSON and the moves).
# Needs a release build (cargo build --release).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${KOCHAB_BIN:-target/release/kochab}
PORT=${PORT:-7700}
CLIENTS=${CLIENTS:-16}
SECS=${SECONDS_LOAD:-90}
WARMUP=${WARMUP:-8}
N=3
tmp=$(mktemp -d /var/tmp/kochab-migration.XXXXXX)
. bench/cluster_lib.sh
trap 'cluster_cleanup; rm -rf "$tmp"' EXIT
d=$tmp/data
key=$d/cluster.key
conn=(--cluster "127.0.0.1:$PORT" --key-file "$key")

# The clients' directories, made while one server holds every table.
cluster_up "$d" 1
"$BIN" bench "${conn[@]}" --clients "$CLIENTS" --items "$CLIENTS" --top-level --base mig \
  --phases create,remove --json >/dev/null
cluster_down

cluster_up "$d" $N
# status --json, or nothing while the cluster does not answer as one.
st() { "$BIN" status --json "${conn[@]}" 2>/dev/null || true; }
# Waits until every server holds at least 19/N tables and nothing moves, twice in a row.
quiet() {
  local ok=0
  for _ in $(seq 600); do
    if st | python3 -c "
import json, sys
v = json.load(sys.stdin)
counts = [len(s.get('tables', [])) for s in v['servers']]
c = v['coordinator']
sys.exit(0 if len(counts) == $N and min(counts) >= 19 // $N and not c['migrations'] and not c['borrows'] else 1)
" 2>/dev/null; then
      ok=$((ok + 1)); [ $ok -ge 2 ] && return 0
    else
      ok=0
    fi
    sleep 0.25
  done
  echo "the cluster did not settle" >&2; exit 1
}
quiet
sleep 1  # servers' cached maps refresh

now_ms() { date +%s%3N; }
: >"$tmp/moves"
: >"$tmp/moved"
"$BIN" bench "${conn[@]}" --clients "$CLIENTS" --items 1000000000 --top-level --base mig \
  --churn "$SECS" --json >"$tmp/churn.json" 2>"$tmp/churn.err" &
bench_pid=$!
sleep "$WARMUP"
# Next move: an unmoved table of the server with the most tables, to the server with the
# fewest (ties: the one with the most unmoved tables, so it gives one next). Prints
# "LO FROM TO BALANCER_MOVES" or nothing when every table has moved.
next_move() {
  st | python3 -c "
import json, sys
v = json.load(sys.stdin)
moved = set(open('$tmp/moved').read().split())
prev = {}
try:
    prev = json.load(open('$tmp/owners'))
except Exception:
    pass
owners = {t['lo']: t['owner'] for t in v['tables']}
extra = sum(1 for t, o in owners.items() if t in prev and prev[t] != o)
servers = [s['id'] for s in v['servers']]
count = {s: 0 for s in servers}
unmoved = {s: [] for s in servers}
for t, o in owners.items():
    count[o] = count.get(o, 0) + 1
    if t not in moved:
        unmoved.setdefault(o, []).append(t)
src = [s for s in servers if unmoved.get(s)]
if not src:
    sys.exit(0)
frm = max(src, key=lambda s: (count[s], len(unmoved[s])))
to = min((s for s in servers if s != frm), key=lambda s: (count[s], -len(unmoved[s])))
print(unmoved[frm][0], frm, to, extra)
"
}
while :; do
  quiet
  m=$(next_move)
  [ -z "$m" ] && break
  read -r lo from to extra <<<"$m"
  t0=$(now_ms)
  "$BIN" table move "$lo" --to "$to" "${conn[@]}" --timeout 120 >>"$tmp/move.log" 2>&1 \
    || { echo "move of $lo failed:" >&2; tail -5 "$tmp/move.log" >&2; exit 1; }
  t1=$(now_ms)
  echo "$lo $from $to $t0 $t1 $extra" | tee -a "$tmp/moves"
  echo "$lo" >>"$tmp/moved"
  st | python3 -c "
import json, sys
v = json.load(sys.stdin)
json.dump({t['lo']: t['owner'] for t in v['tables']}, open('$tmp/owners', 'w'))"
done
moves_done=$(now_ms)
rc=0
wait "$bench_pid" || rc=$?
cat "$tmp/churn.err" >&2
st >"$tmp/final.json"
cluster_down
if [ -n "${JSON_OUT:-}" ]; then
  { cat "$tmp/churn.json"; cat "$tmp/moves"; } >"$JSON_OUT"
fi
python3 - "$tmp/churn.json" "$tmp/moves" "$moves_done" "$rc" "$CLIENTS" "$tmp/final.json" <<'PY'
import json, sys, statistics as st
r = json.load(open(sys.argv[1]))
try:
    final = json.load(open(sys.argv[6]))
    sizes = ' '.join(f"{t['lo'][:4]}:{t['inodes']}" for t in final['tables'] if t.get('inodes'))
    print(f"inodes per table at the end (tables with any): {sizes}")
except Exception as e:
    print(f"no final status ({e})")
moves = [l.split() for l in open(sys.argv[2]) if l.strip()]
moves_done, rc, clients = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
t0 = r['started_unix_ms']
marks = {}
for lo, frm, to, a, b, extra in moves:
    for s in range((int(a) - t0) // 1000, (int(b) - t0) // 1000 + 1):
        marks.setdefault(s, []).append(f"{lo[:4]} {frm}->{to}")
print(f"{'second':>6} {'ops':>7}  moves in this second")
for i, n in enumerate(r['per_second']):
    print(f"{i:>6} {n:>7}  {', '.join(marks.get(i, []))}")
durs = [(int(b) - int(a)) / 1000 for _, _, _, a, b, _ in moves]
first = (int(moves[0][3]) - t0) / 1000 if moves else 0
last = (int(moves[-1][4]) - t0) / 1000 if moves else 0
full = r['per_second'][:int(r['seconds'])]
during = full[int(first):int(last) + 1]
print(f"clients {clients}; load {r['seconds']:.1f} s, {r['ops']} ops, {r['ops_per_sec']:.0f} ops/s")
print(f"tables moved {len(moves)} (one at a time, from {first:.1f} s to {last:.1f} s); "
      f"per move (command start to served at the target, incl. CLI start): "
      f"median {st.median(durs) if durs else 0:.2f} s, max {max(durs) if durs else 0:.2f} s; "
      f"balancer moves in between {sum(int(m[5]) for m in moves)}")
print(f"per second: median {r['median_window']:.0f}, lowest {r['min_window']} "
      f"(dip to {100 * r['dip']:.0f}% of the median); while moving: median "
      f"{st.median(during) if during else 0:.0f}, lowest {min(during) if during else 0}")
print(f"client-visible errors {r['errors']}; creates acked {r['creates_acked']}, renames acked "
      f"{r['renames_acked']}; lost {r['lost']}, doubled {r['doubled']}, ambiguous {r['ambiguous']}")
if r.get('first_error'):
    print(f"first error: {r['first_error']}")
if moves_done // 1000 > t0 // 1000 + int(r['seconds']):
    print("WARNING: the moves outlasted the load; raise SECONDS_LOAD")
sys.exit(0 if rc == 0 and r['errors'] == 0 and r['lost'] == 0 and r['doubled'] == 0 else 1)
PY

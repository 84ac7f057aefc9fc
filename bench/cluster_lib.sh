# Shared by the many-server benchmarks (sourced; needs BIN, PORT and a scratch dir $tmp).

# cluster_up DATA N: starts `kochab up --servers N` in the background and waits until it
# says it is ready (or prints its log and exits).
cluster_up() {
  local d=$1 n=$2
  : >"$tmp/out"
  "$BIN" up --data "$d" --servers "$n" --port "$PORT" ${UP_ARGS:-} >"$tmp/out" 2>>"$tmp/log" &
  echo $! >"$tmp/pid"
  for _ in $(seq 600); do grep -q "cluster ready" "$tmp/out" 2>/dev/null && break; sleep 0.1; done
  grep -q "cluster ready" "$tmp/out" || { echo "cluster of $n did not start; log:" >&2; tail -20 "$tmp/log" >&2; exit 1; }
}

# cluster_down: SIGTERM to that `kochab up`, and wait until it (and so its servers) is gone.
cluster_down() {
  local p; p=$(cat "$tmp/pid")
  kill -TERM "$p" 2>/dev/null || true
  while kill -0 "$p" 2>/dev/null; do sleep 0.05; done
}

# cluster_cleanup: for an EXIT trap.
cluster_cleanup() {
  [ -f "$tmp/pid" ] && kill -TERM "$(cat "$tmp/pid")" 2>/dev/null || true
  sleep 1
  pkill -KILL -f -- "--data $tmp/" 2>/dev/null || true
}

# cluster_wait_spread DATA N: waits until the coordinator (at PORT+N) has spread the tables
# evenly over the N servers and nothing moves (three looks in a row), then 1 s more so the
# servers' cached maps catch up (they answer GetMap from a copy up to 200 ms old).
cluster_wait_spread() {
  local d=$1 n=$2
  local want=$((19 / n)) coord=127.0.0.1:$((PORT + n)) ok=0
  for _ in $(seq 900); do
    if "$BIN" coord-status --json --coord "$coord" --key-file "$d/cluster.key" 2>/dev/null \
      | python3 -c "
import json, sys, collections
s = json.load(sys.stdin)['state']
owners = collections.Counter(t['owner'] for t in s['map'])
even = len(owners) == $n and min(owners.values()) >= $want
sys.exit(0 if even and s['migrations'] == 0 and s['placed'] == s['tables'] else 1)" 2>/dev/null; then
      ok=$((ok + 1)); [ $ok -ge 3 ] && break
    else
      ok=0
    fi
    sleep 0.2
  done
  [ $ok -ge 3 ] || { echo "tables not spread over $n servers" >&2; exit 1; }
  sleep 1
}

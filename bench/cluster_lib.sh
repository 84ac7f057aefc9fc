# Shared by the many-server benchmarks (sourced; needs BIN, PORT and a scratch dir $tmp).

# cluster_up DATA N: starts `kochab up --servers N` in the background and waits until it
# says it is ready (or prints its log and exits).
cluster_up() {
  local d=$1 n=$2
  : >"$tmp/out"
  "$BIN" up --data "$d" --servers "$n" --port "$PORT" >"$tmp/out" 2>>"$tmp/log" &
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

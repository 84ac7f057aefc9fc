# Sourced by the benchmarks that run one `kochab up` and two `kochab mount`s of it
# (two_mounts.sh, watched_write.sh): temp dir and clean-up, and the start of both.
# Needs: PORT set; sets tmp (the run's scratch dir) and pids (what cleanup kills).
[ "$(id -u)" = 0 ] || { echo "needs root" >&2; exit 1; }
tmp=$(mktemp -d "/var/tmp/${TMP_PREFIX:-kbench}.XXXXXX")
pids=()
cleanup() {
  for m in "$tmp"/run/a "$tmp"/run/b "$tmp"/run/m; do fusermount3 -uz "$m" 2>/dev/null || true; done
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT
mounted() { for _ in $(seq 200); do grep -qs " $1 " /proc/mounts && return 0; sleep 0.1; done; return 1; }
# start_two_mounts BIN DIR: a server with its data in DIR/data, mounted at DIR/a and DIR/b
# (logs DIR/up.log, DIR/a.log, DIR/b.log); returns once both are mounted.
start_two_mounts() {
  local bin=$1 d=$2 side
  "$bin" up --data "$d/data" --port "$PORT" >"$d/up.log" 2>&1 &
  pids=($!)
  for _ in $(seq 100); do [ -s "$d/data/cluster.key" ] && break; sleep 0.1; done
  sleep 0.5
  for side in a b; do
    "$bin" mount "127.0.0.1:$PORT" "$d/$side" --foreground --key-file "$d/data/cluster.key" \
      >"$d/$side.log" 2>&1 &
    pids+=($!)
  done
  mounted "$d/a"; mounted "$d/b"
}

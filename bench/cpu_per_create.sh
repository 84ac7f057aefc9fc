#!/usr/bin/env bash
# CPU per create of the kochab process (metadata server and mount together): a fresh
# `kochab up --mount` per run, bench/mdrate.c with 4 processes x FILES (5,000) empty files in
# their own directories, create phase only; utime+stime of the process from /proc. Then,
# per thread name (FUSE request threads, tokio workers, journal flusher...), context
# switches (voluntary and involuntary) and CPU per create from /proc/<pid>/task/*.
# SEPARATE=1: the server (`kochab up`) and the mount (`kochab mount`) in two processes,
# talking over loopback TCP as a mount on another machine would; CPU of both, summed.
# Usage: bench/cpu_per_create.sh [KOCHAB_BIN...]   (root; default target/release/kochab)
# Prints per binary one line cpu_us_per_create=... creates_per_s=..., then a line per thread.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "needs root" >&2; exit 1; }
PORT=${PORT:-7481}
FILES=${FILES:-5000}
SEPARATE=${SEPARATE:-0}
tmp=$(mktemp -d /var/tmp/kcpu.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
gcc -O2 -Wall -o "$tmp/mdrate" bench/mdrate.c -lpthread
hz=$(getconf CLK_TCK)
n=$((4 * FILES))
threads() {  # per thread name: switches, CPU ticks (of every pid given)
  for pid in "$@"; do
    for t in /proc/"$pid"/task/*; do
      { read -r comm <"$t/comm" &&
        sw=$(awk '/ctxt_switches/ {s += $2} END {print s}' "$t/status") &&
        ticks=$(awk '{print $14 + $15}' "$t/stat") &&
        echo "${comm// /_} $sw $ticks"; } 2>/dev/null || true
    done
  done | awk '{c[$1] += $2; u[$1] += $3} END {for (k in c) print k, c[k], u[k]}' | sort
}
ticks() { local s=0 p; for p in "$@"; do s=$((s + $(awk '{print $14 + $15}' "/proc/$p/stat"))); done; echo $s; }
for bin in "${@:-target/release/kochab}"; do
  d="$tmp/run"; rm -rf "$d"; mkdir -p "$d/m"
  if [ "$SEPARATE" = 1 ]; then
    "$bin" up --data "$d/data" --port "$PORT" >"$d/log" 2>&1 &
    pids=($!)
    for _ in $(seq 100); do [ -s "$d/data/cluster.key" ] && break; sleep 0.1; done
    sleep 0.5
    "$bin" mount "127.0.0.1:$PORT" "$d/m" --foreground --key-file "$d/data/cluster.key" \
      >"$d/mount.log" 2>&1 &
    pids+=($!)
  else
    "$bin" up --data "$d/data" --port "$PORT" --mount "$d/m" >"$d/log" 2>&1 &
    pids=($!)
  fi
  for _ in $(seq 200); do grep -qs " $d/m " /proc/mounts && break; sleep 0.1; done
  mkdir -p "$d/m/t"
  threads "${pids[@]}" >"$tmp/before"
  t0=$(ticks "${pids[@]}")
  out=$("$tmp/mdrate" "$d/m/t" 4 "$FILES" unique 0 c)
  t1=$(ticks "${pids[@]}")
  threads "${pids[@]}" >"$tmp/after"
  rate=$(echo "$out" | python3 -c "import json,sys; print(json.load(sys.stdin)['create']['ops_per_sec'])")
  echo "$bin cpu_us_per_create=$(( (t1 - t0) * 1000000 / hz / n )) creates_per_s=$rate"
  join "$tmp/before" "$tmp/after" | awk -v n="$n" -v hz="$hz" '$4 > $2 || $5 > $3 {
    printf "  %-18s switches/create %5.2f  cpu_us/create %6.1f\n", $1, ($4 - $2) / n, ($5 - $3) * 1e6 / hz / n }'
  if [ "$SEPARATE" = 1 ]; then
    fusermount3 -u "$d/m" 2>/dev/null || true
    kill -INT "${pids[1]}" 2>/dev/null || true; wait "${pids[1]}" 2>/dev/null || true
  fi
  kill -INT "${pids[0]}"; wait "${pids[0]}" 2>/dev/null || true
done

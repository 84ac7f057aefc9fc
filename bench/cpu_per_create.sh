#!/usr/bin/env bash
# CPU per create of the kochab process (metadata server and mount together): a fresh
# `kochab up --mount` per run, bench/mdrate.c with 4 processes x 5,000 empty files in their
# own directories, create phase only; utime+stime of the process from /proc.
# Usage: bench/cpu_per_create.sh [KOCHAB_BIN...]   (root; default target/release/kochab)
# Prints one line per binary: cpu_us_per_create and creates_per_s.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "needs root" >&2; exit 1; }
PORT=${PORT:-7481}
tmp=$(mktemp -d /var/tmp/kcpu.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
gcc -O2 -Wall -o "$tmp/mdrate" bench/mdrate.c -lpthread
hz=$(getconf CLK_TCK)
for bin in "${@:-target/release/kochab}"; do
  d="$tmp/run"; rm -rf "$d"; mkdir -p "$d/m"
  "$bin" up --data "$d/data" --port "$PORT" --mount "$d/m" >"$d/log" 2>&1 &
  pid=$!
  for _ in $(seq 200); do grep -qs " $d/m " /proc/mounts && break; sleep 0.1; done
  mkdir -p "$d/m/t"
  t0=$(awk '{print $14 + $15}' "/proc/$pid/stat")
  out=$("$tmp/mdrate" "$d/m/t" 4 5000 unique 0 c)
  t1=$(awk '{print $14 + $15}' "/proc/$pid/stat")
  rate=$(echo "$out" | python3 -c "import json,sys; print(json.load(sys.stdin)['create']['ops_per_sec'])")
  echo "$bin cpu_us_per_create=$(( (t1 - t0) * 1000000 / hz / 20000 )) creates_per_s=$rate"
  kill -INT "$pid"; wait "$pid" 2>/dev/null || true
done

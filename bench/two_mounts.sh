#!/usr/bin/env bash
# Two mounts of one server working in one shared directory at once (the multi-client case
# of the mission, on one machine): bench/mdrate.c, NPROC processes per mount x FILES empty
# files each, create / stat / remove in DIR/shared, both mounts started together. Per
# binary and round: each mount's rates and their sums (a phase's rate on one mount counts
# its own files over its own phase time). For reference, the same total through one mount
# (2 x NPROC processes).
# Usage: bench/two_mounts.sh [KOCHAB_BIN...]   (root; default target/release/kochab)
# Env:   NPROC=2 FILES=2000 PAUSE=2 ROUNDS=3 PORT=7491
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${NPROC:-2}
FILES=${FILES:-2000}
PAUSE=${PAUSE:-2}
ROUNDS=${ROUNDS:-3}
PORT=${PORT:-7491}
TMP_PREFIX=ktwo . bench/lib_two_mounts.sh
gcc -O2 -Wall -o "$tmp/mdrate" bench/mdrate.c -lpthread
rate() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(' '.join('%.0f' % d[p]['ops_per_sec'] for p in ('create','stat','remove')))" "$1"; }
for r in $(seq "$ROUNDS"); do
  for bin in "${@:-target/release/kochab}"; do
    d="$tmp/run"; rm -rf "$d"; mkdir -p "$d/a" "$d/b" "$d/m"
    start_two_mounts "$bin" "$d"
    MDRATE_TAG=a "$tmp/mdrate" "$d/a" "$NPROC" "$FILES" shared "$PAUSE" >"$d/a.json" &
    ma=$!
    MDRATE_TAG=b "$tmp/mdrate" "$d/b" "$NPROC" "$FILES" shared "$PAUSE" >"$d/b.json" &
    mb=$!
    wait "$ma" "$mb"
    read -r ac as ar < <(rate "$d/a.json")
    read -r bc bs br < <(rate "$d/b.json")
    late=$(cat "$d/a.log" "$d/b.log" | grep -c "callback answered before" || true)
    echo "round $r $bin two mounts create/stat/remove: a $ac/$as/$ar b $bc/$bs/$br" \
      "sum $((ac + bc))/$((as + bs))/$((ar + br)) late_callback_warnings=$late"
    fusermount3 -u "$d/a"; fusermount3 -u "$d/b"
    # The same total through one mount, for reference.
    "$bin" mount "127.0.0.1:$PORT" "$d/m" --foreground --key-file "$d/data/cluster.key" \
      >"$d/m.log" 2>&1 &
    pids+=($!)
    mounted "$d/m"
    "$tmp/mdrate" "$d/m" "$((2 * NPROC))" "$FILES" shared "$PAUSE" >"$d/m.json"
    read -r mc ms mr < <(rate "$d/m.json")
    echo "round $r $bin one mount create/stat/remove: $mc/$ms/$mr"
    fusermount3 -u "$d/m"
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
    pids=()
  done
done

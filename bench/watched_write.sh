#!/usr/bin/env bash
# A file written through one mount while another mount watches it (`stat` every
# INTERVAL s, as `watch ls -l` or a progress monitor would): what the writer's write-behind
# costs the watcher, and what watching costs the writer. Per binary and round: dd bs=4k of
# COUNT blocks with conv=fsync through mount a, alone and then watched from mount b; the
# watcher's samples (how many showed a size of 0 while dd ran, and the largest size seen).
# Then in lockstep: LOCKSTEP writes of 100 bytes through one descriptor on a, each followed
# by a stat on b: how many stats showed another size than the bytes written so far, and
# the median time of a write+stat pair.
# Usage: bench/watched_write.sh [KOCHAB_BIN...]   (root; default target/release/kochab)
# Env:   COUNT=65536 INTERVAL=0.2 LOCKSTEP=300 ROUNDS=3 PORT=7493
set -euo pipefail
cd "$(dirname "$0")/.."
COUNT=${COUNT:-65536}
INTERVAL=${INTERVAL:-0.2}
LOCKSTEP=${LOCKSTEP:-300}
ROUNDS=${ROUNDS:-3}
PORT=${PORT:-7493}
TMP_PREFIX=kwatch . bench/lib_two_mounts.sh
rate() { dd if=/dev/zero of="$1" bs=4k count="$COUNT" conv=fsync 2>&1 | awk '/copied/ {print $(NF-1), $NF}'; }
for r in $(seq "$ROUNDS"); do
  for bin in "${@:-target/release/kochab}"; do
    d="$tmp/run"; rm -rf "$d"; mkdir -p "$d/a" "$d/b"
    start_two_mounts "$bin" "$d"
    alone=$(rate "$d/a/alone")
    touch "$d/a/watched"
    stat -c %s "$d/b/watched" >/dev/null
    ( while :; do stat -c %s "$d/b/watched"; sleep "$INTERVAL"; done ) >"$d/sizes" 2>/dev/null &
    watcher=$!
    watched=$(rate "$d/a/watched")
    kill "$watcher"; wait "$watcher" 2>/dev/null || true
    zero=$(grep -c '^0$' "$d/sizes" || true)
    echo "round $r $bin dd 4k: alone $alone, watched $watched;" \
      "watcher: $(wc -l <"$d/sizes") samples, $zero of size 0, largest $(sort -n "$d/sizes" | tail -1)" \
      "(file $((COUNT * 4096)))"
    python3 - "$d/a/step" "$d/b/step" "$LOCKSTEP" <<'PY'
import os, statistics, sys, time
fa, fb, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
open(fa, "w").close()
os.stat(fb)
fd = os.open(fa, os.O_WRONLY)
wrong, pairs = 0, []
for i in range(n):
    t = time.perf_counter()
    os.write(fd, b"x" * 100)
    size = os.stat(fb).st_size
    pairs.append(time.perf_counter() - t)
    wrong += size != 100 * (i + 1)
os.close(fd)
print(f"    lockstep: {wrong} of {n} stats on b showed another size than written on a;"
      f" write+stat median {statistics.median(pairs) * 1e3:.2f} ms")
PY
    fusermount3 -u "$d/a"; fusermount3 -u "$d/b"
    kill "${pids[@]}" 2>/dev/null || true
    wait "${pids[@]}" 2>/dev/null || true
  done
done

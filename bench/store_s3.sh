#!/usr/bin/env bash
# One metadata server on the local store and one on S3 (Ceph RGW), `kochab bench` (durable
# replies) against each in the same run, alternating: create / stat / remove per second with
# p50 and p99, and the journal's writes from the server's metrics (on the local store each
# is a durable write of a segment; on S3 each is one PUT of a journal object): writes per
# second over the create and remove phases, and records per write.
#
# Usage: bench/store_s3.sh [ROUNDS]   (default 1)
# Env: KOCHAB_S3_ENV (the env file `scripts/ceph-rgw.sh up` printed; required), CLIENTS (256),
#      ITEMS (100000), PORT (17700), KOCHAB_BIN, BUCKET (from the env file), SERVERS (1: one
#      server, `kochab up`; N > 1: `kochab up --servers N`, N metadata server processes with
#      their coordinator, on the local store or on S3; the journal line is then left out:
#      the servers of `up --servers` export no metrics).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-1}
BIN=${KOCHAB_BIN:-target/release/kochab}
CLIENTS=${CLIENTS:-256}
ITEMS=${ITEMS:-100000}
PORT=${PORT:-17700}
SERVERS=${SERVERS:-1}
: "${KOCHAB_S3_ENV:?set KOCHAB_S3_ENV to the env file of scripts/ceph-rgw.sh up}"
BUCKET=${BUCKET:-$(sed -n 's/^export KOCHAB_S3_BUCKET=//p' "$KOCHAB_S3_ENV")}
tmp=$(mktemp -d /var/tmp/kochab-store-s3.XXXXXX)
pid=
cleanup() {
  [ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
  rm -rf "$tmp"
}
trap cleanup EXIT

# metric NAME: the value of one counter-like line of the server's metrics.
metric() { curl -s "http://127.0.0.1:$((PORT + 1))/metrics" | awk -v n="$1" '$1 == n { print $2 }'; }

# run STORE ROUND: starts a server on STORE ("local" or "s3"), benchmarks it, stops it.
run() {
  local store=$1 round=$2 data=$tmp/$1-$2 extra=()
  if [ "$store" = s3 ]; then
    extra=(--store "s3://$BUCKET/bench/$(date +%s)-$round" --store-env "$KOCHAB_S3_ENV")
  fi
  if [ "$SERVERS" -gt 1 ]; then
    extra+=(--servers "$SERVERS")
  else
    extra+=(--metrics-port $((PORT + 1)))
  fi
  "$BIN" up --data "$data" --port "$PORT" "${extra[@]}" >"$tmp/$store-$round.log" 2>&1 &
  pid=$!
  for _ in $(seq 300); do grep -qs "cluster ready" "$tmp/$store-$round.log" && break; sleep 0.1; done
  grep -q "cluster ready" "$tmp/$store-$round.log" || { cat "$tmp/$store-$round.log"; exit 1; }
  local w0 r0 out w1 r1
  w0=0 r0=0 w1=0 r1=0
  if [ "$SERVERS" = 1 ]; then
    w0=$(metric kochab_journal_fsync_seconds_count)
    r0=$(metric kochab_journal_records_per_fsync_sum)
  fi
  out=$("$BIN" bench --cluster "127.0.0.1:$PORT" --key-file "$data/cluster.key" \
    --clients "$CLIENTS" --items "$ITEMS")
  if [ "$SERVERS" = 1 ]; then
    w1=$(metric kochab_journal_fsync_seconds_count)
    r1=$(metric kochab_journal_records_per_fsync_sum)
  fi
  kill "$pid"; wait "$pid" 2>/dev/null || true; pid=
  # The journal is written in the create and remove phases (a stat writes nothing): their
  # time is ITEMS / (ops per second) each.
  echo "$out" | awk -v s="$store" -v r="$round" -v items="$ITEMS" -v w="$((w1 - w0))" \
    -v rec="${r1%.*}" -v rec0="${r0%.*}" '
    $1 ~ /^(create|stat|remove)$/ {
      printf "%-6s round %s  %-7s %9s/s  p50 %6s us  p99 %7s us  errors %s\n", s, r, $1, $2, $3, $4, $5
      if ($1 != "stat") t += items / $2
    }
    END { if (w == 0) exit; printf "%-6s round %s  journal writes %d in %.1f s of create and remove: %.0f/s, %.1f records per write\n", s, r, w, t, w / t, (rec - rec0) / w }'
}

echo "$(date -u +%FT%TZ) $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg); $SERVERS server(s), $CLIENTS clients, $ITEMS files"
for round in $(seq "$ROUNDS"); do
  run local "$round"
  run s3 "$round"
done

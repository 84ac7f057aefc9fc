#!/usr/bin/env bash
# Where the time of Kochab's FUSE metadata path goes: runs bench/mdrate.c (NPROC processes x
# FILES empty files, own directories and one shared directory) against a fresh
# `kochab up --mount`, one phase (create, stat, remove) at a time, twice:
#  1. traced: the kernel's fuse:fuse_request_send/end tracepoints give the FUSE requests per
#     operation by opcode and each opcode's latency at the daemon (send -> reply); the
#     server's Prometheus metrics give server operations, journal fsyncs and server-side
#     latency per operation; /proc gives the CPU the kochab process (server + FUSE daemon)
#     and the benchmark processes used per operation;
#  2. sampled: perf record -a -g (cpu-clock, 1999 Hz): share of all samples per process
#     and thread, and the top symbols of each of the busiest threads.
# Then the same two passes for streaming: dd DD_MB MiB of zeros in (bs=1M, conv=fsync) and,
# after dropping the caches, back out (FUSE WRITE/READ requests, their sizes and latency).
# Usage: bench/fuse_profile.sh   Env: FILES=5000 NPROC=4 PORT=7493 MPORT=7494 MODES="unique shared"
#        DD_MB=1024 (0: no streaming passes) KOCHAB_BIN=target/release/kochab KOCHAB_UP_ARGS=
#        FSMARK_N=20000 (0: no fs_mark pass) TOPSYM=12
# Last, a traced pass of fs_mark -n FSMARK_N -s 0 -S 0 -t NPROC (own directories, then one
# shared directory): FUSE requests per file over its create loop and unlink loop together.
set -euo pipefail
cd "$(dirname "$0")/.."
FILES=${FILES:-5000}
NPROC=${NPROC:-4}
PORT=${PORT:-7493}
MPORT=${MPORT:-7494}
MODES=${MODES:-unique shared}
TOPSYM=${TOPSYM:-12}
DD_MB=${DD_MB:-1024}
FSMARK_N=${FSMARK_N:-20000}
BIN=${KOCHAB_BIN:-target/release/kochab}
[ "$(id -u)" = 0 ] || { echo "needs root" >&2; exit 1; }
command -v perf >/dev/null || { echo "needs perf" >&2; exit 1; }

tmp=$(mktemp -d /var/tmp/kfp.XXXXXX)
KM=/mnt/kfp.$$
KPID=
is_mounted() { awk -v m="$1" '$2==m {f=1} END {exit !f}' /proc/mounts; }
cleanup() {
  set +e
  if [ -n "$KPID" ] && kill -0 "$KPID" 2>/dev/null; then
    kill -TERM "$KPID"
    for _ in $(seq 150); do kill -0 "$KPID" 2>/dev/null || break; sleep 0.2; done
    kill -0 "$KPID" 2>/dev/null && { echo "kochab ignored SIGTERM for 30 s: SIGKILL" >&2; kill -KILL "$KPID"; sleep 0.5; }
  fi
  is_mounted "$KM" && { fusermount3 -uz "$KM" 2>/dev/null || umount -l "$KM"; }
  is_mounted "$KM" || rmdir "$KM" 2>/dev/null
  is_mounted "$KM" || rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

gcc -O2 -Wall -o "$tmp/mdrate" bench/mdrate.c -lpthread
cp "$BIN" "$tmp/kochab"
mkdir -p "$KM"
"$tmp/kochab" up --data "$tmp/kdata" --port "$PORT" --metrics-port "$MPORT" --mount "$KM" \
  ${KOCHAB_UP_ARGS:-} >"$tmp/kochab.out" 2>"$tmp/kochab.err" &
KPID=$!
for _ in $(seq 600); do
  grep -q "cluster ready" "$tmp/kochab.out" 2>/dev/null && break
  kill -0 "$KPID" 2>/dev/null || break
  sleep 0.1
done
grep -q "cluster ready" "$tmp/kochab.out" || { cat "$tmp/kochab.err" >&2; exit 1; }
CONN=$(stat -c %d "$KM")   # the FUSE connection id is the mount's device number
echo "kochab pid $KPID, mount $KM (fuse connection $CONN), $(nproc) CPUs, $NPROC processes x $FILES files"

metrics() { curl -s "http://127.0.0.1:$MPORT/metrics" >"$1"; }
cpu_ticks() {  # utime+stime of a process, in clock ticks
  awk '{print $14 + $15}' "/proc/$1/stat"
}
HZ=$(getconf CLK_TCK)

top_by_comm() {  # top_by_comm PERF_DATA: share per thread name, top symbols of the busiest
  local -; set +o pipefail   # head closes the pipe early: perf report's SIGPIPE is no error
  echo "  share of all samples by process/thread (comm):"
  perf report -i "$1" --no-children --sort comm --stdio 2>/dev/null \
    | grep -E '^ +[0-9.]+%' | head -8 | sed 's/^/   /'
  for comm in $(perf report -i "$1" --no-children --sort comm --stdio 2>/dev/null \
                | grep -E '^ +[0-9.]+%' | head -4 | awk '{print $2}'); do
    [ "$comm" = swapper ] && continue
    echo "  top symbols of $comm (% of all samples):"
    perf report -i "$1" --no-children --comms "$comm" --sort dso,sym --stdio 2>/dev/null \
      | grep -E '^ +[0-9.]+%' | head -"$TOPSYM" | cut -c1-150 | sed 's/^/   /'
  done
}

for mode in $MODES; do
  d="$KM/prof-$mode"
  mkdir "$d"
  echo
  echo "==================== $mode directories: traced pass ===================="
  for ph in c s r; do
    sleep 1.5   # beyond the mount's 1 s entry/attribute cache, as in fuse_compare.sh
    metrics "$tmp/m0"; k0=$(cpu_ticks "$KPID")
    perf record -q -e fuse:fuse_request_send -e fuse:fuse_request_end -a -o "$tmp/trace.data" -- \
      /usr/bin/time -f "%U %S" -o "$tmp/time" "$tmp/mdrate" "$d" "$NPROC" "$FILES" "$mode" 0 "$ph" \
      >"$tmp/res" 2>"$tmp/perf.err" || { cat "$tmp/perf.err" >&2; exit 1; }
    k1=$(cpu_ticks "$KPID"); metrics "$tmp/m1"
    perf script -i "$tmp/trace.data" -F time,event,trace 2>/dev/null >"$tmp/trace.txt"
    python3 - "$tmp/res" "$tmp/trace.txt" "$CONN" "$tmp/m0" "$tmp/m1" "$((k1 - k0))" "$HZ" \
      "$(cat "$tmp/time")" "$((NPROC * FILES))" <<'PY'
import json, re, sys, statistics as st
res, trace, conn, m0, m1, kt, hz, tm, n = sys.argv[1:10]
n = int(n); hz = int(hz)
j = json.load(open(res))
ph, r = next(iter(j.items()))
print(f"--- {ph}: {r['ops_per_sec']:.0f} ops/s, p50 {r['p50_us']:.0f} us, p99 {r['p99_us']:.0f} us, errors {r['errors']} (under tracing)")
# FUSE requests of this mount: count per opcode, daemon latency (send -> end)
sent, lat, counts = {}, {}, {}
rx = re.compile(r'\s*([\d.]+):\s+fuse:(fuse_request_\w+):\s+connection (\d+) req (\d+)(?: opcode \d+ \((\w+)\))?')
for line in open(trace):
    m = rx.match(line)
    if not m or m.group(3) != conn:
        continue
    t, ev, _, req, op = m.groups()
    if ev == 'fuse_request_send':
        sent[req] = (float(t), op)
        counts[op] = counts.get(op, 0) + 1
    elif req in sent:
        t0, op = sent.pop(req)
        lat.setdefault(op, []).append((float(t) - t0) * 1e6)
print(f"  FUSE requests per {ph}: " + ", ".join(
    f"{op.replace('FUSE_', '')} {c / n:.2f} (p50 {st.median(lat.get(op, [0])):.0f} us)"
    for op, c in sorted(counts.items(), key=lambda x: -x[1])))
# server metrics
def parse(path):
    d = {}
    for line in open(path):
        if line.startswith('#') or not line.strip():
            continue
        k, v = line.rsplit(' ', 1)
        try:
            d[k] = float(v)
        except ValueError:
            pass
    return d
a, b = parse(m0), parse(m1)
diff = {k: b[k] - a.get(k, 0) for k in b if b[k] - a.get(k, 0) > 0}
ops = {k: v for k, v in diff.items() if k.startswith('kochab_operations_total') or k.startswith('operations_total')}
line = []
for k, v in sorted(ops.items(), key=lambda x: -x[1]):
    lab = re.search(r'\{(.*)\}', k)
    lab = lab.group(1) if lab else k
    lab = ','.join(x.split('=')[1].strip('"') for x in lab.split(','))
    line.append(f"{lab} {v / n:.2f}")
print("  server operations per " + ph + ": " + ", ".join(line))
lat_sum = {k: v for k, v in diff.items() if '_seconds_sum' in k and 'latency' in k}
for k, v in sorted(lat_sum.items(), key=lambda x: -x[1])[:6]:
    c = diff.get(k.replace('_sum', '_count'), 0)
    if c:
        print(f"  server latency {re.sub(r'^.*?_seconds_sum', '', k)}: mean {v / c * 1e6:.0f} us over {c:.0f}")
for name in ('fsync_seconds', 'records_per_fsync'):
    ks = [k for k in diff if k.endswith(name + '_count') or k.endswith(name + '_sum')]
    s = sum(diff[k] for k in ks if k.endswith('_sum')); c = sum(diff[k] for k in ks if k.endswith('_count'))
    if c:
        print(f"  journal {name}: {c:.0f} fsyncs ({c / n:.2f} per {ph}), mean {s / c * (1e6 if 'seconds' in name else 1):.1f}"
              + (" us" if 'seconds' in name else " records"))
u, s = (float(x) for x in tm.split())
print(f"  CPU per {ph}: kochab process {int(kt) / hz / n * 1e6:.1f} us; benchmark processes user {u / n * 1e6:.1f} us + sys {s / n * 1e6:.1f} us (incl. kernel FUSE client)")
PY
  done
  rmdir "$d"

  echo
  echo "==================== $mode directories: sampled pass (perf record -a -g) ===================="
  mkdir "$d"
  for ph in c s r; do
    sleep 1.5
    perf record -q -a -g -F 1999 -e cpu-clock -o "$tmp/cpu.data" -- \
      "$tmp/mdrate" "$d" "$NPROC" "$FILES" "$mode" 0 "$ph" >"$tmp/res" 2>"$tmp/perf.err" \
      || { cat "$tmp/perf.err" >&2; exit 1; }
    echo "--- $ph: $(cut -c1-160 "$tmp/res")"
    top_by_comm "$tmp/cpu.data"
  done
  rmdir "$d"
done
if [ "$DD_MB" -gt 0 ]; then
  for pass in traced sampled; do
    echo
    echo "==================== streaming, $DD_MB MiB: $pass pass ===================="
    if [ $pass = traced ]; then rec=(-e fuse:fuse_request_send -e fuse:fuse_request_end)
    else rec=(-g -F 1999 -e cpu-clock); fi
    for dir in write read; do
      if [ $dir = write ]; then
        rm -f "$KM/big"; sync; echo 3 >/proc/sys/vm/drop_caches
        cmd=(dd if=/dev/zero of="$KM/big" bs=1M count="$DD_MB" conv=fsync)
      else
        sync; echo 3 >/proc/sys/vm/drop_caches
        cmd=(dd if="$KM/big" of=/dev/null bs=1M)
      fi
      k0=$(cpu_ticks "$KPID")
      perf record -q -a "${rec[@]}" -o "$tmp/s.data" -- "${cmd[@]}" 2>"$tmp/dd.err" >/dev/null \
        || { cat "$tmp/dd.err" >&2; exit 1; }
      k1=$(cpu_ticks "$KPID")
      echo "--- $dir: $(grep copied "$tmp/dd.err"); kochab process CPU $(( (k1 - k0) * 1000 / HZ )) ms"
      if [ $pass = traced ]; then
        perf script -i "$tmp/s.data" -F time,event,trace 2>/dev/null | python3 -c '
import re, sys, statistics as st
conn = sys.argv[1]
rx = re.compile(r"\s*([\d.]+):\s+fuse:(fuse_request_\w+):\s+connection (\d+) req (\d+)(?: opcode \d+ \((\w+)\) len (\d+))?")
sent, lat, counts, lens = {}, {}, {}, {}
for line in sys.stdin:
    m = rx.match(line)
    if not m or m.group(3) != conn:
        continue
    t, ev, _, req, op, ln = m.groups()
    if ev == "fuse_request_send":
        sent[req] = (float(t), op); counts[op] = counts.get(op, 0) + 1
        lens.setdefault(op, []).append(int(ln))
    elif req in sent:
        t0, op = sent.pop(req); lat.setdefault(op, []).append((float(t) - t0) * 1e6)
for op, c in sorted(counts.items(), key=lambda x: -x[1])[:6]:
    l = sorted(lat.get(op, [0]))
    print(f"  {op}: {c} requests, median request length {st.median(lens[op]):.0f} bytes, "
          f"latency p50 {st.median(l):.0f} us p99 {l[len(l) * 99 // 100]:.0f} us")
' "$CONN"
      else
        top_by_comm "$tmp/s.data"
      fi
    done
  done
  rm -f "$KM/big"
fi
if [ "$FSMARK_N" -gt 0 ] && command -v fs_mark >/dev/null; then
  for mode in unique shared; do
    echo
    echo "==================== fs_mark $mode directories, $NPROC x $FSMARK_N files: traced pass ===================="
    d="$KM/fm"; mkdir "$d"; dirs=()
    if [ $mode = unique ]; then for i in $(seq 0 $((NPROC - 1))); do dirs+=(-d "$d/t$i"); done
    else dirs=(-d "$d/s"); fi
    sleep 1.5
    perf record -q -e fuse:fuse_request_send -e fuse:fuse_request_end -a -o "$tmp/fm.data" -- \
      fs_mark "${dirs[@]}" -n "$FSMARK_N" -s 0 -S 0 -t "$NPROC" -v -l "$tmp/fm.log" 2>&1 \
      | awk 'hdr && NF >= 23 {print "  fs_mark: files/s " $4 ", app overhead " $5 " us, creat avg " $7 " us, close avg " $19 " us, unlink avg " $22 " us"; exit} /^FSUse%/ {hdr=1}'
    perf script -i "$tmp/fm.data" -F time,event,trace 2>/dev/null | python3 -c '
import re, sys, statistics as st
conn, n = sys.argv[1], int(sys.argv[2])
rx = re.compile(r"\s*([\d.]+):\s+fuse:(fuse_request_\w+):\s+connection (\d+) req (\d+)(?: opcode \d+ \((\w+)\))?")
sent, lat, counts = {}, {}, {}
for line in sys.stdin:
    m = rx.match(line)
    if not m or m.group(3) != conn:
        continue
    t, ev, _, req, op = m.groups()
    if ev == "fuse_request_send":
        sent[req] = (float(t), op); counts[op] = counts.get(op, 0) + 1
    elif req in sent:
        t0, op = sent.pop(req); lat.setdefault(op, []).append((float(t) - t0) * 1e6)
short = lambda op: op[5:] if op.startswith("FUSE_") else op
print("  FUSE requests per file (create loop + unlink loop): " + ", ".join(
    f"{short(op)} {c / n:.2f} (p50 {st.median(lat.get(op, [0])):.0f} us)"
    for op, c in sorted(counts.items(), key=lambda x: -x[1]) if c / n >= 0.01))
' "$CONN" "$((NPROC * FSMARK_N))"
    rm -rf "$d"
  done
fi
kill -0 "$KPID" 2>/dev/null || echo "WARNING: kochab exited during the profile"

#!/usr/bin/env bash
# Scaling, Ursa Minor Fig. 3 style: `kochab bench` (durable) against clusters of 1, 2, 4
# and 8 metadata server processes (`kochab up --servers N`), each server capped at
# CPU_SHARE of one CPU with cgroup v1 (its own group under /sys/fs/cgroup/cpu, the pid
# written to cgroup.procs so later threads follow), the coordinator and the load generator
# uncapped. Two workloads per point: every client in its own top-level directory
# (`--top-level`: the id policy deals them across tables) and all clients in one shared
# directory (one table: it cannot scale until huge directories are split).
#
# The directories are made first by a one-server cluster, which holds every table: a mkdir
# whose new id lands in a table of another server needs BORROW/RETURN, which is not wired
# yet (such a server allocates in its own tables instead). The cluster is then restarted
# with N servers over the same data, and the coordinator spreads the tables before the
# measured run.
#
# It also prints the servers' CPU per create: user+system time of every server process
# (/proc/PID/stat, all threads) read around the create phase, divided by the creates; and
# their context switches per create (voluntary and not, every thread's
# /proc/PID/task/*/status). With PERF=1 also the servers' pwrite64 calls per second in the
# create phase (perf tracepoints; the journal's durable writes, checkpoints aside). At the
# end, `dd oflag=dsync`'s synced 4 KiB writes per second on the same disk.
#
# Usage: bench/scaling.sh [ROUNDS] [SERVER_COUNTS...]   (default: 3 rounds of 1 2 4 8)
# Env: CPU_SHARE (0.1), CLIENTS (64), ITEMS_PER_SERVER (40000), KOCHAB_BIN, PORT (7600),
#      MODES ("unique shared"), PERF (0), SERVER_THREADS (1: worker threads per server; a server held to a tenth of a CPU
#      does more with one worker than with two), JSON_OUT (file for the raw rows),
#      MULTI_SERVER (unset: the server's default; else passed as `--multi-server`).
# Needs root (cgroups) and a release build (cargo build --release).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
shift || true
COUNTS=("$@")
[ ${#COUNTS[@]} -eq 0 ] && COUNTS=(1 2 4 8)
BIN=${KOCHAB_BIN:-target/release/kochab}
PORT=${PORT:-7600}
CPU_SHARE=${CPU_SHARE:-0.1}
CLIENTS=${CLIENTS:-64}
PER=${ITEMS_PER_SERVER:-40000}
UP_ARGS="--threads ${SERVER_THREADS:-1}${MULTI_SERVER:+ --multi-server $MULTI_SERVER}"
CG=/sys/fs/cgroup/cpu/kochab-scaling
tmp=$(mktemp -d /var/tmp/kochab-scaling.XXXXXX)
. bench/cluster_lib.sh
cleanup() {
  cluster_cleanup
  for g in "$CG"/s*; do [ -d "$g" ] && rmdir "$g" 2>/dev/null; done
  rmdir "$CG" 2>/dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT
mkdir -p "$CG"
period=100000
quota=$(python3 -c "print(int($period*$CPU_SHARE))")

server_pids() {  # server_pids DATA: the metadata server processes of the cluster on DATA
  pgrep -f -- "mds --id .* --data $1\$|mds --id .* --data $1 "
}
cpu_ticks() {  # cpu_ticks PID...: user+system clock ticks of those processes, all threads
  local t=0 pid f
  for pid in "$@"; do
    f=$(cut -d')' -f2- "/proc/$pid/stat")
    t=$((t + $(echo "$f" | awk '{print $12 + $13}')))
  done
  echo "$t"
}

switches() {  # switches PID...: context switches of those processes, all threads
  local pid
  for pid in "$@"; do cat /proc/"$pid"/task/*/status 2>/dev/null; done |
    awk '/ctxt_switches/ {s += $2} END {print s + 0}'
}

start() {  # start DATA N [nocap]
  local d=$1 n=$2 nocap=${3:-}
  cluster_up "$d" "$n"
  [ -n "$nocap" ] && return 0
  cluster_wait_spread "$d" "$n"
  # Cap each server process in its own group.
  local i=0 pid
  for pid in $(server_pids "$d"); do
    mkdir -p "$CG/s$i"
    echo $period >"$CG/s$i/cpu.cfs_period_us"
    echo "$quota" >"$CG/s$i/cpu.cfs_quota_us"
    echo "$pid" >"$CG/s$i/cgroup.procs"
    i=$((i + 1))
  done
  [ "$i" -eq "$n" ] || { echo "found $i server processes, expected $n"; exit 1; }
}

: >"$tmp/results"
for r in $(seq "$ROUNDS"); do
  for n in "${COUNTS[@]}"; do
    for mode in ${MODES:-unique shared}; do
      d="$tmp/data-$n-$mode-$r"
      flag=(--top-level); [ $mode = shared ] && flag=(--shared-dir)
      # The clients' directories, made while one server holds every table.
      start "$d" 1 nocap
      "$BIN" bench --cluster 127.0.0.1:$PORT --key-file "$d/cluster.key" --clients "$CLIENTS" \
        --items "$CLIENTS" "${flag[@]}" --phases create,remove --json >/dev/null
      cluster_down
      start "$d" "$n"
      items=$((PER * n))
      # Creates and stats in two invocations (names are deterministic), so the servers'
      # CPU can be read around the create phase alone.
      pids=$(server_pids "$d")
      if [ "${PERF:-0}" = 1 ]; then
        perf stat -x, -e syscalls:sys_enter_pwrite64 -p "$(echo $pids | tr ' ' ,)" \
          -o "$tmp/perf" &
        perf_pid=$!
      fi
      cpu0=$(cpu_ticks $pids)
      sw0=$(switches $pids)
      t0=$(date +%s.%N)
      jc=$("$BIN" bench --cluster 127.0.0.1:$PORT --key-file "$d/cluster.key" --clients "$CLIENTS" \
            --items $items "${flag[@]}" --phases create --json)
      t1=$(date +%s.%N)
      cpu1=$(cpu_ticks $pids)
      sw1=$(switches $pids)
      pw=0
      if [ "${PERF:-0}" = 1 ]; then
        kill -INT $perf_pid; wait $perf_pid || true
        pw=$(awk -F, '/pwrite64/ {print $1 + 0}' "$tmp/perf")
      fi
      js=$("$BIN" bench --cluster 127.0.0.1:$PORT --key-file "$d/cluster.key" --clients "$CLIENTS" \
            --items $items "${flag[@]}" --phases stat --json)
      j=$(python3 -c 'import json,sys
c=json.loads(sys.argv[1]); s=json.loads(sys.argv[2]); hz=int(sys.argv[4])
c["create"]["server_cpu_us_per_op"]=(int(sys.argv[3])*1e6/hz)/int(sys.argv[5])
c["create"]["server_switches_per_op"]=int(sys.argv[6])/int(sys.argv[5])
if int(sys.argv[7]): c["create"]["server_pwrites_per_sec"]=int(sys.argv[7])/float(sys.argv[8])
c.update(s); print(json.dumps(c))' "$jc" "$js" $((cpu1 - cpu0)) "$(getconf CLK_TCK)" $items \
        $((sw1 - sw0)) "$pw" "$(python3 -c "print($t1 - $t0)")")
      restarts=$(grep -c "exited" "$tmp/log" || true)
      cluster_down
      echo "$n $mode $r $restarts $j" | tee -a "$tmp/results"
      rm -rf "$d"
    done
  done
done
[ -n "${JSON_OUT:-}" ] && cp "$tmp/results" "$JSON_OUT"
# What the disk does alone: synced 4 KiB writes per second, for the journals' pwrites.
/usr/bin/time -f %e -o "$tmp/dd_s" dd if=/dev/zero of="$tmp/dd" bs=4k count=3000 oflag=dsync \
  2>/dev/null
dd_s=$(tail -1 "$tmp/dd_s")
echo "dd bs=4k count=3000 oflag=dsync: $dd_s s, $(python3 -c "print(round(3000 / $dd_s))") synced writes/s"
rm -f "$tmp/dd"
python3 - "$tmp/results" <<'PY'
import json, sys, statistics as st
rows = {}
cpu = {}
sw = {}
pw = {}
for line in open(sys.argv[1]):
    n, mode, r, restarts, rest = line.split(' ', 4)
    d = json.loads(rest)
    for ph, v in d.items():
        rows.setdefault((mode, ph, int(n)), []).append(v['ops_per_sec'])
        if 'server_cpu_us_per_op' in v:
            cpu.setdefault((mode, int(n)), []).append(v['server_cpu_us_per_op'])
        if 'server_switches_per_op' in v:
            sw.setdefault((mode, int(n)), []).append(v['server_switches_per_op'])
        if 'server_pwrites_per_sec' in v:
            pw.setdefault((mode, int(n)), []).append(v['server_pwrites_per_sec'])
print(f"{'workload':<8} {'phase':<7} {'servers':>7} {'ops/s (median)':>15} {'vs 1 server':>12}  runs")
for mode in ('unique', 'shared'):
    for ph in ('create', 'stat'):
        base = None
        for n in sorted({k[2] for k in rows if k[0] == mode and k[1] == ph}):
            v = rows[(mode, ph, n)]
            m = st.median(v)
            base = base or (m if n == 1 else None)
            ratio = f"{m / base:.2f}x" if base else "-"
            print(f"{mode:<8} {ph:<7} {n:>7} {m:>15.0f} {ratio:>12}  {' '.join(f'{x:.0f}' for x in v)}")
print()
print(f"{'workload':<8} {'servers':>7} {'server CPU us per create (median)':>34} {'vs 1 server':>12}  runs")
for mode in ('unique', 'shared'):
    base = None
    for n in sorted({k[1] for k in cpu if k[0] == mode}):
        v = cpu[(mode, n)]
        m = st.median(v)
        base = base or (m if n == 1 else None)
        ratio = f"{m / base:.2f}x" if base else "-"
        print(f"{mode:<8} {n:>7} {m:>34.2f} {ratio:>12}  {' '.join(f'{x:.2f}' for x in v)}")
print()
print(f"{'workload':<8} {'servers':>7} {'server context switches per create':>35} {'pwrite64/s, all servers':>24}")
for mode in ('unique', 'shared'):
    for n in sorted({k[1] for k in sw if k[0] == mode}):
        m = st.median(sw[(mode, n)])
        p = f"{st.median(pw[(mode, n)]):.0f}" if (mode, n) in pw else "-"
        print(f"{mode:<8} {n:>7} {m:>35.3f} {p:>24}")
PY

#!/usr/bin/env bash
# Kochab's FUSE mount beside MooseFS's mount and local ext4, in one run on this machine:
#  1. metadata: bench/mdrate.c (the workload of `kochab bench`: NPROC processes each create,
#     stat and remove FILES empty files, own directory / one shared directory), and
#     fs_mark -n FSMARK_N -s 0 -S 0 -t NPROC -v, own directory per process (-d x NPROC) and
#     one shared directory (a single -d: fs_mark then runs every process in that directory);
#  2. streaming: dd 1 GiB of zeros with conv=fsync, drop caches, dd it back, md5sum (after
#     another drop of the caches) against the md5 of zeros; plus a random-data copy check;
#  3. dd4k: dd DD4K_MB (256) MiB of zeros in 4 KiB writes with conv=fsync (small writes:
#     the mount's write-behind), then its md5 after a drop of the caches;
#  4. tarfind: two `tar -x` processes at once, each extracting a Linux source tree of
#     zero-length files (Debian's linux-source, its files emptied: $KTREE, built once) into
#     its own directory; then, after a drop of the caches, two `find` processes at once, one
#     over each tree. Entries/s = entries of both trees / wall time.
# Every round runs every workload on every file system (the order of the file systems
# rotates per round); medians over ROUNDS rounds, every run printed.
#
# Usage: bench/fuse_compare.sh [ROUNDS]      (needs root and a release build of kochab)
# Env:   FILES=5000 NPROC=4 FSMARK_N=20000 DD_MB=1024 DD4K_MB=256 RAND_MB=256 PAUSE=2
#        FSLIST="kochab kochab_nofsync moosefs ext4 ext4j"  WORKLOADS="mdrate fsmark dd dd4k"  WARMUP=1
#        (WORKLOADS may add tarfind; KTREE=/var/tmp/kochab-ktree.tar)
#          kochab: `kochab up --mount` (durable: no reply before its journal record is on disk);
#          kochab_nofsync: the same with --no-fsync (buffered, as MooseFS's master is);
#          kochab_base: `kochab up --mount` of KOCHAB_BASE_BIN (an earlier build), for a
#          same-run A/B of two versions;
#          kochab_sync: `kochab up --mount --mount-options sync` (no write-behind: every
#          write(2) is a round trip, as before it existed; no early replies either);
#          kochab_s3: `kochab up --mount --store s3://BUCKET/fuse-compare/PID` on the store of
#          KOCHAB_S3_ENV (the env file `scripts/ceph-rgw.sh up` printed): journal and file
#          data as objects in Ceph RGW;
#          kochab_dirsync: `kochab up --mount --mount-options dirsync` (every metadata change
#          durable before its reply, as before early replies existed);
#          bindfs: Debian's bindfs, a FUSE passthrough to a directory of the local ext4 (the
#          cost of FUSE itself; installed if missing);
#          ext4: a directory on /var/tmp (this root file system has no ext4 journal, and then
#          ext4 skips inodes deleted in the last 60-300 s when it allocates: creates right
#          after mass deletions are slow and erratic); ext4j: a fresh ext4 with a journal in a
#          loop file under /var/tmp (no such skipping), for reference.
#        PORT=7491  KOCHAB_BIN=target/release/kochab  KOCHAB_UP_ARGS=  (e.g. --no-fsync)
#        QUIET_PCT=25 (wait, up to 120 s, for a second with less CPU use than this before
#        each measurement; the machine is shared). Each raw line carries busy=B/F: B = % CPU
#        busy in the second before the measurement, F = % of all CPU time during it used by
#        anything but the workload and our daemons (other users of the machine, kernel threads).
# Output: raw lines and a summary on stdout; raw results kept in $OUT (default
#        bench/out/fuse_compare-<time>.txt, not removed).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
FILES=${FILES:-5000}
NPROC=${NPROC:-4}
FSMARK_N=${FSMARK_N:-20000}
DD_MB=${DD_MB:-1024}
DD4K_MB=${DD4K_MB:-256}
RAND_MB=${RAND_MB:-256}
PAUSE=${PAUSE:-2}
FSLIST=${FSLIST:-kochab kochab_nofsync moosefs ext4 ext4j}
WORKLOADS=${WORKLOADS:-mdrate fsmark dd dd4k}
WARMUP=${WARMUP:-1}
PORT=${PORT:-7491}
QUIET_PCT=${QUIET_PCT:-25}
BIN=${KOCHAB_BIN:-target/release/kochab}
PEERS=/work/shared/peers
MFS_MNT=/mnt/peer-moosefs
mkdir -p bench/out
OUT=${OUT:-bench/out/fuse_compare-$(date +%Y%m%d-%H%M%S).txt}
: >"$OUT"

[ "$(id -u)" = 0 ] || { echo "needs root" >&2; exit 1; }
[ -x "$BIN" ] || { echo "no $BIN: cargo build --release -p kochab" >&2; exit 1; }
if ! command -v fs_mark >/dev/null; then
  echo "installing fsmark" >&2
  apt-get -o DPkg::Lock::Timeout=600 update -q >&2
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -q \
    --no-install-recommends fsmark >&2
fi
command -v gcc >/dev/null || { echo "needs gcc" >&2; exit 1; }

tmp=$(mktemp -d /var/tmp/kfc.XXXXXX)   # short paths: fs_mark takes directories < 40 bytes
# Kochab's mount points, and ext4j's, live outside $tmp: never rm -rf a mounted tree.
KM=/mnt/kfc.$$                  # kochab (durable, the default mode)
KMB=/mnt/kfcb.$$                # kochab_nofsync (kochab up --no-fsync)
KMA=/mnt/kfca.$$                # kochab_base (KOCHAB_BASE_BIN)
KMS=/mnt/kfcs.$$                # kochab_sync (kochab up --mount-options sync)
KMD=/mnt/kfcd.$$                # kochab_dirsync (kochab up --mount-options dirsync)
KM3=/mnt/kfc3.$$                # kochab_s3 (kochab up --store s3://...)
EJ=/mnt/kfce.$$                 # ext4j: a fresh journaled ext4 in a loop file under $tmp
BF=/mnt/kfcf.$$                 # bindfs: a FUSE passthrough of $tmp/b (local ext4)
KPIDS=()
MFS_UP=0
is_mounted() { awk -v m="$1" '$2==m {f=1} END {exit !f}' /proc/mounts; }
cleanup() {
  set +e
  local pid m
  for pid in "${KPIDS[@]}"; do
    kill -0 "$pid" 2>/dev/null || continue
    kill -TERM "$pid"
    for _ in $(seq 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    if kill -0 "$pid" 2>/dev/null; then
      echo "kochab $pid did not stop within 30 s of SIGTERM: SIGKILL" >&2
      kill -KILL "$pid"; sleep 0.5
    fi
  done
  for m in "$KM" "$KMB" "$KMA" "$KMS" "$KMD" "$KM3"; do
    if is_mounted "$m"; then
      echo "$m still mounted after kochab stopped: lazy unmount" >&2
      fusermount3 -uz "$m" 2>/dev/null || umount -l "$m"
    fi
  done
  is_mounted "$EJ" && umount "$EJ"     # mount -o loop frees its loop device itself
  is_mounted "$BF" && { fusermount3 -u "$BF" 2>/dev/null || umount -l "$BF"; }
  for m in "$KM" "$KMB" "$KMA" "$KMS" "$KMD" "$EJ" "$BF"; do is_mounted "$m" || rmdir "$m" 2>/dev/null; done
  [ "$MFS_UP" = 1 ] && timeout 300 "$PEERS/moosefs/down.sh" >/dev/null 2>&1
  is_mounted "$KM" || is_mounted "$KMB" || is_mounted "$KMA" || is_mounted "$KMS" || is_mounted "$KMD" || is_mounted "$EJ" || is_mounted "$BF" || rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

log() { echo "[$(date +%H:%M:%S)] $*" >&2; }

# Waits (at most 120 s) for a 1-second window in which the machine's CPUs are less busy than
# QUIET_PCT percent; prints the busy percentage of the last window.
cpu_busy() {
  local a b
  a=($(head -1 /proc/stat)); sleep 1; b=($(head -1 /proc/stat))
  local tot=0 idle i
  for i in 1 2 3 4 5 6 7 8; do tot=$((tot + b[i] - a[i])); done
  idle=$(( (b[4] - a[4]) + (b[5] - a[5]) ))
  echo $(( tot > 0 ? 100 * (tot - idle) / tot : 0 ))
}
quiet() {
  local busy t
  for t in $(seq 120); do
    busy=$(cpu_busy)
    [ "$busy" -lt "$QUIET_PCT" ] && break
  done
  echo "$busy"
}

# Foreign CPU during a measurement: all CPU time the machine spent (not idle) minus what our
# daemons (kochab, MooseFS) and the workload itself used, as a percentage of all CPU time.
# meas_start; ...workload under /usr/bin/time -a -o "$tmp/cpu"...; meas_foreign
SYS0=0; OWN0=0; T0=0
sys_busy() { awk '/^cpu / {print $2 + $3 + $4 + $7 + $8 + $9; exit}' /proc/stat; }
sys_total() { awk '/^cpu / {print $2 + $3 + $4 + $5 + $6 + $7 + $8 + $9; exit}' /proc/stat; }
own_daemons() {
  local pids=("${KPIDS[@]}") f
  for f in /var/tmp/peer-moosefs/pid/*.pid; do [ -s "$f" ] && pids+=("$(tr -dc 0-9 <"$f")"); done
  local sum=0 p v
  for p in "${pids[@]}"; do
    v=$(awk '{print $14 + $15}' "/proc/$p/stat" 2>/dev/null) || continue
    sum=$((sum + ${v:-0}))
  done
  echo "$sum"
}
meas_start() { : >"$tmp/cpu"; SYS0=$(sys_busy); T0=$(sys_total); OWN0=$(own_daemons); }
meas_foreign() {
  local sys1 t1 own1 work
  sys1=$(sys_busy); t1=$(sys_total); own1=$(own_daemons)
  work=$(awk -v hz="$(getconf CLK_TCK)" '{u += $1; s += $2} END {printf "%d", (u + s) * hz}' "$tmp/cpu")
  awk -v b=$((sys1 - SYS0)) -v t=$((t1 - T0)) -v o=$((own1 - OWN0)) -v w="$work" \
    'BEGIN {f = t > 0 ? 100 * (b - o - w) / t : 0; if (f < 0) f = 0; printf "%d", f}'
}
TIMED=(/usr/bin/time -a -f "%U %S" -o)   # "${TIMED[@]}" "$tmp/cpu" CMD...: CPU of CMD and its children

# ---------- build the helper, start the file systems ----------
gcc -O2 -Wall -o "$tmp/mdrate" bench/mdrate.c -lpthread
cp "$BIN" "$tmp/kochab"          # a rebuild during the run must not change the binary
if [[ " $FSLIST " == *" kochab_base "* ]]; then
  [ -x "${KOCHAB_BASE_BIN:-}" ] || { echo "kochab_base needs KOCHAB_BASE_BIN" >&2; exit 1; }
  cp "$KOCHAB_BASE_BIN" "$tmp/kochab-base"
fi
mnt_of() {
  case $1 in
    kochab) echo "$KM" ;;
    kochab_nofsync) echo "$KMB" ;;
    kochab_base) echo "$KMA" ;;
    kochab_sync) echo "$KMS" ;;
    kochab_dirsync) echo "$KMD" ;;
    kochab_s3) echo "$KM3" ;;
    moosefs) echo "$MFS_MNT" ;;
    ext4) echo "$tmp/e" ;;
    ext4j) echo "$EJ" ;;
    bindfs) echo "$BF" ;;
  esac
}
start_kochab() {  # start_kochab NAME PORT MOUNT [up args...]
  local name=$1 port=$2 m=$3 pid bin="$tmp/kochab"; shift 3
  [ "$name" = kochab_base ] && bin="$tmp/kochab-base"
  mkdir -p "$m"
  ! is_mounted "$m" || { echo "$m already mounted" >&2; exit 1; }
  "$bin" up --data "$tmp/data-$name" --port "$port" --mount "$m" "$@" \
    >"$tmp/$name.out" 2>"$tmp/$name.err" &
  pid=$!
  KPIDS+=("$pid")
  for _ in $(seq 600); do
    grep -q "cluster ready" "$tmp/$name.out" 2>/dev/null && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  grep -q "cluster ready" "$tmp/$name.out" && is_mounted "$m" \
    || { echo "$name did not come up:" >&2; cat "$tmp/$name.err" >&2; exit 1; }
  log "$name up (pid $pid, kochab up $* ) at $m: $(cat "$tmp/$name.out")"
}
for fs in $FSLIST; do
  case $fs in
    kochab) start_kochab kochab "$PORT" "$KM" ${KOCHAB_UP_ARGS:-} ;;
    kochab_nofsync) start_kochab kochab_nofsync "$((PORT + 1))" "$KMB" --no-fsync ${KOCHAB_UP_ARGS:-} ;;
    kochab_base) start_kochab kochab_base "$((PORT + 2))" "$KMA" ;;
    kochab_sync) start_kochab kochab_sync "$((PORT + 3))" "$KMS" --mount-options sync ${KOCHAB_UP_ARGS:-} ;;
    kochab_dirsync) start_kochab kochab_dirsync "$((PORT + 4))" "$KMD" --mount-options dirsync ${KOCHAB_UP_ARGS:-} ;;
    kochab_s3)
      : "${KOCHAB_S3_ENV:?kochab_s3 needs KOCHAB_S3_ENV (the env file of scripts/ceph-rgw.sh up)}"
      start_kochab kochab_s3 "$((PORT + 5))" "$KM3" \
        --store "s3://$(sed -n 's/^export KOCHAB_S3_BUCKET=//p' "$KOCHAB_S3_ENV")/fuse-compare/$$" \
        --store-env "$KOCHAB_S3_ENV" ${KOCHAB_UP_ARGS:-} ;;
    moosefs)
      if is_mounted "$MFS_MNT"; then
        echo "$MFS_MNT is already mounted (someone else's run?): not touching it" >&2; exit 1
      fi
      MFS_UP=1
      timeout 900 "$PEERS/moosefs/up.sh" >&2 || { echo "moosefs up.sh failed" >&2; exit 1; }
      ;;
    ext4) mkdir -p "$tmp/e" ;;
    bindfs)
      if ! command -v bindfs >/dev/null; then
        echo "installing bindfs" >&2
        apt-get -o DPkg::Lock::Timeout=600 update -q >&2
        DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -q \
          --no-install-recommends bindfs >&2
      fi
      mkdir -p "$tmp/b" "$BF"
      bindfs "$tmp/b" "$BF"
      log "bindfs: $tmp/b (local ext4) through FUSE at $BF"
      ;;
    ext4j)
      truncate -s 8G "$tmp/ext4j.img"
      mkfs.ext4 -q -F "$tmp/ext4j.img"
      mkdir -p "$EJ"
      mount -o loop "$tmp/ext4j.img" "$EJ"
      log "ext4j: fresh ext4 (with journal) on a loop file, mounted at $EJ"
      ;;
    *) echo "unknown file system $fs" >&2; exit 1 ;;
  esac
done
log "file systems: $FSLIST; kernel $(uname -r); $(nproc) CPUs"
log "raw results: $OUT"

# ---------- workloads; each appends "round fs workload data..." to $OUT ----------
record() { echo "$*" | tee -a "$OUT"; }

run_mdrate() {  # run_mdrate ROUND FS MODE
  local r=$1 fs=$2 mode=$3 m d j busy
  m=$(mnt_of "$fs"); d="$m/fc-md-$$-$r-$mode"
  mkdir "$d"
  busy=$(quiet)
  meas_start
  j=$(timeout -k 10 900 "${TIMED[@]}" "$tmp/cpu" "$tmp/mdrate" "$d" "$NPROC" "$FILES" "$mode" "$PAUSE") \
    || { log "mdrate $mode on $fs failed ($?)"; j='{}'; }
  busy="$busy/$(meas_foreign)"
  rmdir "$d" 2>/dev/null || { log "leftovers in $d:"; ls "$d" | head >&2; rm -rf "$d"; }
  record "$r $fs mdrate-$mode busy=$busy $j"
}

run_fsmark() {  # run_fsmark ROUND FS MODE
  local r=$1 fs=$2 mode=$3 m d dirs=() i line busy
  m=$(mnt_of "$fs"); d="$m/fm$r${mode:0:1}"
  mkdir "$d"
  if [ "$mode" = unique ]; then
    for i in $(seq 0 $((NPROC - 1))); do dirs+=(-d "$d/t$i"); done
  else
    dirs=(-d "$d/shared")
  fi
  busy=$(quiet)
  meas_start
  line=$( cd "$tmp" && timeout -k 10 1200 "${TIMED[@]}" "$tmp/cpu" fs_mark "${dirs[@]}" -n "$FSMARK_N" -s 0 -S 0 \
            -t "$NPROC" -v -l "$tmp/fs_mark.log" 2>&1 | tee "$tmp/fs_mark.last" \
          | awk 'hdr && NF >= 23 {print; exit} /^FSUse%/ {hdr=1}' ) || true
  busy="$busy/$(meas_foreign)"
  [ -n "$line" ] || { log "fs_mark $mode on $fs failed:"; head -3 "$tmp/fs_mark.last" >&2; }
  rm -rf "$d"
  record "$r $fs fsmark-$mode busy=$busy ${line:-failed}"
}

dd_secs() { awk -F', ' '/copied/ {sub(/ s$/, "", $3); split($1, a, " "); print a[1], $3}'; }
drop_caches() { sync; echo 3 >/proc/sys/vm/drop_caches; }
ZERO_MD5=
run_dd() {  # run_dd ROUND FS
  local r=$1 fs=$2 m f w rd md5 ok rok busy
  m=$(mnt_of "$fs"); f="$m/fc-big-$$"
  [ -n "$ZERO_MD5" ] || ZERO_MD5=$(head -c $((DD_MB << 20)) /dev/zero | md5sum | cut -d' ' -f1)
  rm -f "$f"; drop_caches
  busy=$(quiet)
  meas_start
  w=$(timeout -k 10 600 "${TIMED[@]}" "$tmp/cpu" dd if=/dev/zero of="$f" bs=1M count="$DD_MB" conv=fsync 2>&1 | dd_secs)
  drop_caches
  rd=$(timeout -k 10 600 "${TIMED[@]}" "$tmp/cpu" dd if="$f" of=/dev/null bs=1M 2>&1 | dd_secs)
  busy="$busy/$(meas_foreign)"
  drop_caches
  md5=$(timeout -k 10 600 md5sum "$f" | cut -d' ' -f1)
  ok=$([ "$md5" = "$ZERO_MD5" ] && echo md5ok || echo "md5BAD:$md5")
  rm -f "$f"
  # random data: copy, drop caches, compare checksums (zeros could hide holes served as zeros)
  rok=skipped
  if [ "$RAND_MB" -gt 0 ]; then
    [ -f "$tmp/rand" ] || head -c $((RAND_MB << 20)) /dev/urandom >"$tmp/rand"
    timeout -k 10 600 dd if="$tmp/rand" of="$f.r" bs=1M conv=fsync status=none
    drop_caches
    if cmp -s "$tmp/rand" "$f.r"; then rok=randok; else rok=randBAD; cmp "$tmp/rand" "$f.r" >&2 || true; fi
    rm -f "$f.r"
  fi
  record "$r $fs dd busy=$busy write ${w:-failed failed} read ${rd:-failed failed} $ok $rok"
}

run_dd4k() {  # run_dd4k ROUND FS
  local r=$1 fs=$2 m f w md5 ok busy
  m=$(mnt_of "$fs"); f="$m/fc-small-$$"
  rm -f "$f"; drop_caches
  busy=$(quiet)
  meas_start
  w=$(timeout -k 10 600 "${TIMED[@]}" "$tmp/cpu" dd if=/dev/zero of="$f" bs=4k count=$((DD4K_MB * 256)) conv=fsync 2>&1 | dd_secs)
  busy="$busy/$(meas_foreign)"
  drop_caches
  md5=$(timeout -k 10 600 md5sum "$f" | cut -d' ' -f1)
  ok=$([ "$md5" = "$(head -c $((DD4K_MB << 20)) /dev/zero | md5sum | cut -d' ' -f1)" ] && echo md5ok || echo "md5BAD:$md5")
  rm -f "$f"
  record "$r $fs dd4k busy=$busy write ${w:-failed failed} $ok"
}

# The tar of a Linux source tree with every file emptied (built once from linux-source).
KTREE=${KTREE:-/var/tmp/kochab-ktree.tar}
KTREE_ENTRIES=0
prepare_ktree() {
  if [ ! -s "$KTREE" ]; then
    local src
    # No match is an empty answer, not an exit (set -e with pipefail).
    src=$(ls /usr/src/linux-source-*.tar.xz 2>/dev/null | head -1 || true)
    if [ -z "$src" ]; then
      log "installing linux-source (for the tar tree)"
      apt-get -o DPkg::Lock::Timeout=600 update -q >&2
      DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -q \
        --no-install-recommends linux-source >&2
      src=$(ls /usr/src/linux-source-*.tar.xz | head -1)
    fi
    log "building $KTREE from $src (files emptied)"
    rm -rf "$tmp/kt"; mkdir -p "$tmp/kt"
    tar -tJf "$src" | (cd "$tmp/kt" && python3 -c '
import os, sys
for line in sys.stdin:
    p = line.rstrip("\n")
    if not p:
        continue
    if p.endswith("/"):
        os.makedirs(p, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(p) or ".", exist_ok=True)
        open(p, "w").close()
')
    tar -cf "$KTREE.tmp" -C "$tmp/kt" . && mv "$KTREE.tmp" "$KTREE"
    rm -rf "$tmp/kt"
  fi
  KTREE_ENTRIES=$(tar -tf "$KTREE" | wc -l)
  log "tar tree: $KTREE, $KTREE_ENTRIES entries"
}
[[ " $WORKLOADS " == *" tarfind "* ]] && prepare_ktree

run_tarfind() {  # run_tarfind ROUND FS
  local r=$1 fs=$2 m d t0 t1 t2 busy tok=ok
  m=$(mnt_of "$fs"); d="$m/fc-tar-$$-$r"
  mkdir -p "$d/a" "$d/b"
  busy=$(quiet)
  meas_start
  t0=$(date +%s.%N)
  timeout -k 10 1800 tar -xf "$KTREE" -C "$d/a" & local p1=$!
  timeout -k 10 1800 tar -xf "$KTREE" -C "$d/b" & local p2=$!
  wait "$p1" || tok=failed; wait "$p2" || tok=failed
  t1=$(date +%s.%N)
  drop_caches
  local fa fb
  t1b=$(date +%s.%N)
  fa=$(mktemp); fb=$(mktemp)
  timeout -k 10 1800 find "$d/a" >"$fa" & p1=$!
  timeout -k 10 1800 find "$d/b" >"$fb" & p2=$!
  wait "$p1" || tok=failed; wait "$p2" || tok=failed
  t2=$(date +%s.%N)
  busy="$busy/$(meas_foreign)"
  local found=$(( $(wc -l <"$fa") + $(wc -l <"$fb") - 2 ))
  rm -f "$fa" "$fb"
  rm -rf "$d"
  record "$r $fs tarfind busy=$busy tar $((2 * KTREE_ENTRIES)) $(echo "$t1 - $t0" | bc) find $found $(echo "$t2 - $t1b" | bc) $tok"
}

if [ "$WARMUP" = 1 ]; then
  # First touch of guest memory is expensive on this VM: fill and drop the page cache once
  # (2 GiB through ext4) so that no file system pays for it inside a measurement.
  log "warm-up: 2 GiB through the page cache of $tmp"
  dd if=/dev/zero of="$tmp/warm" bs=1M count=2048 status=none; cat "$tmp/warm" >/dev/null
  rm -f "$tmp/warm"; drop_caches
fi

fsarr=($FSLIST)
nfs=${#fsarr[@]}
for r in $(seq "$ROUNDS"); do
  order=()
  for i in $(seq 0 $((nfs - 1))); do order+=("${fsarr[$(( (i + r - 1) % nfs ))]}"); done
  log "round $r/$ROUNDS: ${order[*]}"
  for w in $WORKLOADS; do
    for fs in "${order[@]}"; do
      case $w in
        mdrate) run_mdrate "$r" "$fs" unique; run_mdrate "$r" "$fs" shared ;;
        fsmark) run_fsmark "$r" "$fs" unique; run_fsmark "$r" "$fs" shared ;;
        dd) run_dd "$r" "$fs" ;;
        dd4k) run_dd4k "$r" "$fs" ;;
        tarfind) run_tarfind "$r" "$fs" ;;
      esac
    done
  done
done

for pid in "${KPIDS[@]}"; do
  kill -0 "$pid" 2>/dev/null || log "WARNING: kochab pid $pid exited during the run"
done
for f in "$tmp"/kochab*.err; do
  [ -f "$f" ] || continue
  grep -iE "error|panic|warn" "$f" | head -20 | sed "s|^|$(basename "$f"): |" >&2 || true
done

python3 bench/fuse_summary.py "$OUT" "$NPROC" | tee "$OUT.summary"

#!/usr/bin/env bash
# Builds the cargo-fuzz targets in fuzz/ and runs each for a bounded time (docs/TESTING.md).
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]
# Default: 10 s each, all four targets. The suite (scripts/test.sh) runs them briefly so
# that they keep compiling and nothing they reach panics; run longer by hand, e.g.
#   nice -n 15 scripts/fuzz.sh 600 frame
#
# It uses the stable toolchain: libFuzzer comes from the libfuzzer-sys crate, and the
# coverage instrumentation is the same as cargo-fuzz's (sancov passes, stable flags)
# without AddressSanitizer, which needs nightly (`cargo +nightly fuzz run TARGET` adds it;
# Rust code needs it only for `unsafe`). Corpora grow in fuzz/corpus/TARGET and crashes
# are saved in fuzz/artifacts/TARGET/ (neither is committed).
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
secs=${1:-10}
shift || true
targets=("$@")
if ((${#targets[@]} == 0)); then
  targets=(frame request journal_record checkpoint)
fi
# Each target's inputs are bounded (frames, segments and images of at most this many
# bytes): larger ones only slow a short run down.
max_len=65536
export RUSTFLAGS="--cfg fuzzing -Cpasses=sancov-module \
 -Cllvm-args=-sanitizer-coverage-level=4 \
 -Cllvm-args=-sanitizer-coverage-inline-8bit-counters \
 -Cllvm-args=-sanitizer-coverage-pc-table \
 -Cllvm-args=-sanitizer-coverage-trace-compares \
 -Cdebug-assertions -Coverflow-checks"
# An explicit --target keeps RUSTFLAGS off build scripts and proc macros (as cargo-fuzz
# does): they run on the host and have no libFuzzer to link.
host=$(rustc -vV | sed -n 's/^host: //p')
cargo build --release --locked --bins --target "$host"
bin="target/$host/release"
for t in "${targets[@]}"; do
  mkdir -p "corpus/$t" "artifacts/$t"
  echo "fuzz: $t for ${secs} s"
  log="target/fuzz-$t.log"
  # -rss_limit_mb: a leak or a huge allocation fails the run instead of the machine.
  if ! "$bin/$t" "corpus/$t" -max_total_time="$secs" -max_len="$max_len" \
    -rss_limit_mb=2048 -artifact_prefix="artifacts/$t/" -print_final_stats=1 >"$log" 2>&1; then
    tail -n 60 "$log" >&2
    echo "fuzz: $t failed; the input is in fuzz/artifacts/$t/" >&2
    exit 1
  fi
  grep -E '^Done [0-9]+ runs|^stat::(number_of_executed_units|new_units_added)' "$log" | tr '\n' ' '
  echo
done

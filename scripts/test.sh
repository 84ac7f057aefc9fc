#!/usr/bin/env bash
# The test suite: formatting, lints, then every test (unit, engine, real server processes
# killed with SIGKILL or a simulated power loss, FUSE mounts), all in release mode so one
# build serves them all; then the fuzz targets, built and run for a few seconds each.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export PATH="$HOME/.cargo/bin:$PATH"
start=$(date +%s)
cargo fmt --all -- --check
cargo clippy --release --locked --workspace --all-targets -q -- -D warnings
# The S3 store's tests run against a throw-away Ceph RGW (docs/STORE.md); KOCHAB_S3_TESTS=0
# skips both.
KOCHAB_S3_ENV=$(scripts/ceph-rgw.sh up)
export KOCHAB_S3_ENV
trap 'scripts/ceph-rgw.sh down' EXIT
cargo test --release --locked --workspace -q
# The FUSE conformance and differential suites again over /dev/fuse where the kernel
# offers io_uring (which every mount takes by default): both transports stay covered.
if [ "$(cat /sys/module/fuse/parameters/enable_uring 2>/dev/null)" = Y ]; then
  KOCHAB_FUSE_URING=0 cargo test --release --locked -q -p kochab \
    --test fuse_conformance --test fuse_differential
fi
# The differential suite once more with the cluster's state and file data on RGW (fewer
# steps: every close and fsync there waits for the store).
KOCHAB_DIFF_STORE=s3 KOCHAB_DIFF_STEPS=3000 cargo test --release --locked -q -p kochab \
  --test fuse_differential
echo "tests passed in $(( $(date +%s) - start )) s"
# The fuzz targets (their own workspace): built, and each run briefly (docs/TESTING.md).
fuzz_start=$(date +%s)
scripts/fuzz.sh 10
echo "fuzz targets built and run in $(( $(date +%s) - fuzz_start )) s"

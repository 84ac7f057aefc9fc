#!/usr/bin/env bash
# The test suite: formatting, lints, then every test (unit, engine, real server processes
# killed with SIGKILL, FUSE mounts), all in release mode so one build serves them all.
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
echo "tests passed in $(( $(date +%s) - start )) s"

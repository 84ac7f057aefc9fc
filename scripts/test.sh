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
cargo test --release --locked --workspace -q
echo "tests passed in $(( $(date +%s) - start )) s"

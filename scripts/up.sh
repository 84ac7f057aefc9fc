#!/usr/bin/env bash
# Builds Kochab and runs an embedded cluster in the foreground. Arguments go to `kochab up`
# (e.g. --data DIR, --port P, --mount DIR). Stop it with Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export PATH="$HOME/.cargo/bin:$PATH"
cargo build --release --locked -q -p kochab
exec target/release/kochab up "$@"

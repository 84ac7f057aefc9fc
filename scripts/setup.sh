#!/usr/bin/env bash
# Installs what Kochab needs on a fresh Debian machine: the Rust toolchain (if missing) and
# the Debian packages the tests use (fuse3 for mounting; programs the FUSE tests run;
# systemd for `systemd-analyze verify` of the example mount unit; stress-ng), and fsx, the
# File System eXerciser, from crates.io into target/tools.
# Safe to run repeatedly; does nothing when everything is present.
set -euo pipefail

PKGS=(fuse3 rsync sqlite3 git make gcc libc6-dev tar diffutils findutils util-linux procps systemd stress-ng)

missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup: need root to install: ${missing[*]}" >&2
    exit 1
  fi
  echo "setup: installing ${missing[*]}" >&2
  apt-get -o DPkg::Lock::Timeout=600 update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends "${missing[@]}" >/dev/null
fi

# FUSE over io_uring (Linux 6.14+): the kernel leaves it off until this parameter is set.
# Mounts take it by default where it is on (KOCHAB_FUSE_URING=0 keeps /dev/fuse).
uring=/sys/module/fuse/parameters/enable_uring
[ -e /sys/module/fuse ] || modprobe fuse 2>/dev/null || true
if [ -w "$uring" ] && [ "$(cat "$uring")" != Y ]; then
  if echo Y 2>/dev/null >"$uring"; then
    echo "setup: enabled FUSE over io_uring" >&2
  fi
fi

if ! command -v cargo >/dev/null 2>&1; then
  if [ -x "$HOME/.cargo/bin/cargo" ]; then
    export PATH="$HOME/.cargo/bin:$PATH"
  else
    echo "setup: installing the Rust toolchain with rustup" >&2
    curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal --default-toolchain 1.95.0 -c clippy,rustfmt
    export PATH="$HOME/.cargo/bin:$PATH"
  fi
fi
cargo --version >/dev/null

# fsx (the Rust port of the File System eXerciser, crates.io), for crates/cli/tests/fsx.rs.
# Built once into target/tools; the version is pinned so every run exercises the same.
fsx_version=0.2.0
tools=$(cd "$(dirname "$0")/.." && pwd)/target/tools
if ! "$tools/bin/fsx" --version 2>/dev/null | grep -qF "$fsx_version"; then
  echo "setup: installing fsx $fsx_version into target/tools" >&2
  cargo install -q --locked --root "$tools" fsx --version "$fsx_version"
fi

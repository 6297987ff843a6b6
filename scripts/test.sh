#!/usr/bin/env bash
# Runs tongs' whole test suite on a fresh machine: installs what the tests need, then cargo test.
# Usage: bash scripts/test.sh [extra cargo test arguments]
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages the tests call: `kill` (procps) sends SIGTERM to the tongs binary in tests/cli.rs.
need=()
command -v kill >/dev/null 2>&1 || need+=(procps)
if ((${#need[@]})); then
  echo "test.sh: installing ${need[*]}" >&2
  if [ "$(id -u)" -ne 0 ]; then
    echo "test.sh: missing ${need[*]} and not root; install them and rerun" >&2
    exit 1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
fi
command -v cargo >/dev/null 2>&1 || { echo "test.sh: cargo is missing (install Rust with rustup)" >&2; exit 1; }

cargo test --locked --all-targets "$@"

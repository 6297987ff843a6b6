#!/usr/bin/env bash
# The overload scenario of the back-pressure work: open-loop load at twice the capacity of a
# heterogeneous simulated fleet (4 nodes, capacities 8/4/4/2, mean service 120/250/350/600 ms), through
# tongs (adaptive limit, static limit, adaptive with a bounded queue) and through HAProxy (leastconn,
# maxconn per server = the node's capacity, timeout queue). Prints markdown tables.
#
#   bash benches/overload.sh                                   # 60 s per contender, about 5 minutes
#   DURATION=10s CONTENDERS="adaptive haproxy" SEED=2 bash benches/overload.sh
#
# Installs HAProxy from the Debian package when it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=${DURATION:-60s}

if ! command -v haproxy >/dev/null 2>&1; then
  echo "overload.sh: installing haproxy" >&2
  sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || {
      echo "overload.sh: haproxy is missing, and installing it needs root or sudo; install the Debian package haproxy and rerun" >&2
      exit 1
    }
    sudo=(sudo)
  fi
  if ! { "${sudo[@]}" apt-get update -qq &&
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq haproxy; } >&2; then
    echo "overload.sh: could not install the Debian package haproxy; install it and rerun" >&2
    exit 1
  fi
  command -v haproxy >/dev/null 2>&1 || {
    echo "overload.sh: haproxy is still not on PATH after installing the Debian package haproxy" >&2
    exit 1
  }
fi
command -v cargo >/dev/null 2>&1 || { echo "overload.sh: cargo is missing (install Rust with rustup)" >&2; exit 1; }

# Clients, tongs and the fleet share this process: up to a few thousand sockets at once.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
if git rev-parse --git-dir >/dev/null 2>&1; then
  echo "commit: $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- src || echo ' with uncommitted changes in src/')"
fi
DURATION=$DURATION cargo bench --quiet --bench overload

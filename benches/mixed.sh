#!/usr/bin/env bash
# The mixed-fleet scenario of the balancing work: one simulated fleet of 6 nodes with mean service times
# from 20 ms to 600 ms (capacity 4 each, no interruptions), open-loop load at 60 % of its capacity,
# through tongs with each balancer policy (expected-latency, least-outstanding) and through nginx
# (least_conn), one after the other in the same run. Prints one markdown table and each node's share.
#
#   bash benches/mixed.sh                        # 60 s per contender, about 4 minutes after the build
#   DURATION=10s LOAD=0.6 bash benches/mixed.sh
#
# Installs nginx from the Debian package when it is missing (needs root).
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=${DURATION:-60s}
LOAD=${LOAD:-0.6}
PATH=$PATH:/usr/sbin:/sbin

if ! command -v nginx >/dev/null 2>&1; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "mixed.sh: nginx is missing, and installing it needs root; install the Debian package nginx (apt-get install nginx) and rerun" >&2
    exit 1
  fi
  echo "mixed.sh: installing nginx" >&2
  if ! { apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx; } >&2; then
    echo "mixed.sh: could not install the Debian package nginx; install it and rerun" >&2
    exit 1
  fi
  command -v nginx >/dev/null 2>&1 || {
    echo "mixed.sh: nginx is still not on PATH after installing the Debian package nginx" >&2
    exit 1
  }
fi
command -v cargo >/dev/null 2>&1 || { echo "mixed.sh: cargo is missing (install Rust with rustup)" >&2; exit 1; }

# Clients, tongs and the fleet share one process: a few hundred sockets at once, more when a contender lags.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
DURATION=$DURATION LOAD=$LOAD cargo bench --quiet --bench mixed

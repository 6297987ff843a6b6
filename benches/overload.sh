#!/usr/bin/env bash
# The overload scenario of the back-pressure work: open-loop load at twice the capacity of a
# heterogeneous simulated fleet (4 nodes, capacities 8/4/4/2, mean service 120/250/350/600 ms), through
# tongs (adaptive limit, static limit, adaptive with a bounded queue) and through HAProxy (leastconn,
# maxconn per server = the node's capacity, timeout queue). Prints markdown tables.
#
#   bash benches/overload.sh                                   # 60 s per contender, about 5 minutes
#   DURATION=10s CONTENDERS="adaptive haproxy" SEED=2 bash benches/overload.sh
#
# Installs HAProxy from the Debian package when it is missing (needs root or sudo).
set -euo pipefail
cd "$(dirname "$0")/.."
source benches/lib.sh

DURATION=${DURATION:-60s}

install_missing overload.sh haproxy
need_cargo overload.sh
raise_fd_limit
if git rev-parse --git-dir >/dev/null 2>&1; then
  echo "commit: $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- src || echo ' with uncommitted changes in src/')"
fi
DURATION=$DURATION cargo bench --quiet --bench overload

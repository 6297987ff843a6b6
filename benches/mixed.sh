#!/usr/bin/env bash
# The mixed-fleet scenario of the balancing work: one simulated fleet of 6 nodes with mean service times
# from 20 ms to 600 ms (capacity 4 each, no interruptions), open-loop load at 60 % of its capacity,
# through tongs with each balancer policy (expected-latency, least-outstanding) and through nginx
# (least_conn), one after the other in the same run. Prints one markdown table and each node's share.
#
#   bash benches/mixed.sh                        # 60 s per contender, about 4 minutes after the build
#   DURATION=10s LOAD=0.6 bash benches/mixed.sh
#
# Installs nginx from the Debian package when it is missing (needs root or sudo).
set -euo pipefail
cd "$(dirname "$0")/.."
source benches/lib.sh

DURATION=${DURATION:-60s}
LOAD=${LOAD:-0.6}

install_missing mixed.sh nginx
need_cargo mixed.sh
raise_fd_limit
DURATION=$DURATION LOAD=$LOAD cargo bench --quiet --bench mixed

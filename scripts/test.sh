#!/usr/bin/env bash
# Runs tongs' whole test suite on a fresh machine: installs what the tests need, then cargo test.
# Usage: bash scripts/test.sh [extra cargo test arguments]
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages the tests call: `kill` (procps) sends SIGTERM to the tongs binary in tests/config/cli.rs;
# a real Prometheus scrapes tongs (tests/admin/prometheus.rs) and its promtool checks and unit-tests the alert
# rules (tests/deploy/alerts.rs); headless Chromium loads the status page
# (tests/admin/status_page.rs); kubectl renders deploy/ with kustomize (tests/deploy/); microsocks and tinyproxy
# play tailscaled's SOCKS5 and HTTP CONNECT proxies (tests/upstream/transports.rs); nginx, HAProxy and Caddy
# are the peers whose configurations the comparison benchmark's smoke pass starts and serves through
# (benches/compare/, run by `cargo test --all-targets`); shellcheck, curl and jq check and run the GPU node's
# registration script (tests/deploy/node_script.rs).
export PATH=$PATH:/usr/sbin:/sbin
need=()
command -v kill >/dev/null 2>&1 || need+=(procps)
{ command -v prometheus && command -v promtool; } >/dev/null 2>&1 || need+=(prometheus)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v kubectl >/dev/null 2>&1 || need+=(kubernetes-client)
command -v microsocks >/dev/null 2>&1 || need+=(microsocks)
command -v tinyproxy >/dev/null 2>&1 || need+=(tinyproxy)
command -v nginx >/dev/null 2>&1 || need+=(nginx)
command -v haproxy >/dev/null 2>&1 || need+=(haproxy)
command -v caddy >/dev/null 2>&1 || need+=(caddy)
command -v shellcheck >/dev/null 2>&1 || need+=(shellcheck)
command -v curl >/dev/null 2>&1 || need+=(curl)
command -v jq >/dev/null 2>&1 || need+=(jq)
if ((${#need[@]})); then
  echo "test.sh: installing ${need[*]}" >&2
  if [ "$(id -u)" -ne 0 ]; then
    echo "test.sh: missing ${need[*]} and not root; install them and rerun" >&2
    exit 1
  fi
  apt-get update -qq
  # --no-install-recommends: prometheus would otherwise pull in its node exporter and start services.
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}"
fi
command -v cargo >/dev/null 2>&1 || { echo "test.sh: cargo is missing (install Rust with rustup)" >&2; exit 1; }

# More tests at once than cores: the integration tests mostly wait on sockets, timers and child processes,
# so libtest's default (one test per core) leaves a 2-core machine idle. Measured on a shared 2-core
# machine, whole suite: 181 s and 199 s at the default, 137 s and 141 s at 4, 123 s and 125 s at 8. Four,
# not eight: at eight, one clean-clone run in five failed a test whose SOCKS proxy never answered (a
# port found free taken by another test before microsocks bound it is the likely cause; those tests now
# check who answers); fewer at once keep such races rarer.
# The benches' smoke passes run one binary at a time either way. An explicit RUST_TEST_THREADS wins.
if [ -z "${RUST_TEST_THREADS:-}" ]; then
  cores=$(nproc)
  RUST_TEST_THREADS=$((cores > 4 ? cores : 4))
  export RUST_TEST_THREADS
fi
cargo test --locked --all-targets "$@"

#!/usr/bin/env bash
# Runs tongs' coverage-guided fuzz targets (fuzz/) for a fixed number of inputs from a fixed seed, so a
# run is repeatable: the configuration file, endpoint URLs / allowlist rules / node addresses, the
# headers nodes and clients send, a node's stream as a continued OpenAI stream reads it, a request
# body's model as pools read and rewrite it, a model server's metrics page, and a prompt's block hashes.
# Usage: bash scripts/fuzz.sh [RUNS_SCALE]   (1 = CI's bounded run; 10 = ten times the inputs)
# Needs cargo-fuzz (installed from crates.io when missing); builds without a sanitizer, on the stable
# toolchain, so it needs nothing but what `cargo` already has. A crash leaves its input in
# fuzz/artifacts/TARGET/ and fails the run.
set -euo pipefail
cd "$(dirname "$0")/.."
scale=${1:-1}
if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "fuzz.sh: installing cargo-fuzz from crates.io" >&2
  cargo install cargo-fuzz --locked --version 0.13.2
fi
cd fuzz
cargo fuzz build -s none
# Inputs per target: each takes 5 to 15 s on one core at scale 1.
for target_runs in config:200000 addresses:5000000 headers:5000000 stream:200000 model:2000000 engine:400000 prompt:500000; do
  target=${target_runs%%:*}
  runs=$(( ${target_runs#*:} * scale ))
  echo "fuzz.sh: $target, $runs inputs" >&2
  # An empty corpus directory of this run's own: the seed alone decides the inputs.
  corpus=$(mktemp -d)
  cargo fuzz run -s none "$target" "$corpus" -- -seed=1 -runs="$runs" -max_len=4096 2>&1 | tail -n 3
  rm -rf "$corpus"
done

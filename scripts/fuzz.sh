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
# Inputs per target: each takes 5 to 15 s on one core at scale 1. libFuzzer runs on one core, so the
# targets run two at a time (JOBS, default the machine's cores): on CI's 2 cores, half the wall time.
jobs=${JOBS:-$(nproc)}
logs=$(mktemp -d)
run_target() {
  local target=${1%%:*}
  local runs=$(( ${1#*:} * scale ))
  # An empty corpus directory of this run's own: the seed alone decides the inputs.
  local corpus
  corpus=$(mktemp -d)
  local status=0
  cargo fuzz run -s none "$target" "$corpus" -- -seed=1 -runs="$runs" -max_len=4096 >"$logs/$target.log" 2>&1 || status=$?
  rm -rf "$corpus"
  echo "fuzz.sh: $target, $runs inputs: $(tail -n 1 "$logs/$target.log")" >&2
  if [ "$status" -ne 0 ]; then
    echo "fuzz.sh: $target FAILED (exit $status); its log ends:" >&2
    tail -n 40 "$logs/$target.log" >&2
  fi
  return "$status"
}
pids=()
failed=0
for target_runs in config:200000 addresses:5000000 headers:5000000 stream:200000 model:2000000 engine:400000 prompt:500000; do
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do
    wait -n || failed=1
  done
  run_target "$target_runs" &
  pids+=($!)
done
for pid in "${pids[@]}"; do
  wait "$pid" || failed=1
done
rm -rf "$logs"
if [ "$failed" -ne 0 ]; then
  echo "fuzz.sh: a target failed; its crashing input is in fuzz/artifacts/" >&2
  exit 1
fi

#!/usr/bin/env bash
# The churn scenario of the resilience work: the demo fleet (6 heterogeneous simulated GPU nodes, every
# interruption kind on a seeded schedule) behind tongs with its defaults, under open-loop load, against
# the same fleet calm in the same run, with each balancer policy. Prints one markdown table.
#
#   bash benches/churn.sh                    # 60 s per run, 40 and 67 req/s, seed 1, both policies
#   DURATION=30s RATES="40" SEEDS="1 2" POLICIES=expected-latency bash benches/churn.sh
#
# 67 req/s is half the fleet's nominal capacity (sum of capacity / mean service time = 134 req/s).
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=${DURATION:-60s}
RATES=${RATES:-"40 67"}
SEEDS=${SEEDS:-1}
POLICIES=${POLICIES:-"expected-latency least-outstanding"}

command -v python3 >/dev/null || { echo "churn.sh: python3 is needed to read the JSON summaries" >&2; exit 1; }
cargo build --release --quiet
tongs=target/release/tongs

echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
echo "machine: $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
echo "scenario: tongs demo --duration $DURATION (6 nodes, service 120..700 ms, every interruption kind), defaults"
echo
echo "| req/s | seed | policy | fleet | requests | success % | failed | retried | attempts/req | p50 ms | p99 ms | max ms | p99 vs calm |"
echo "| ---: | ---: | --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"
for rate in $RATES; do
  for seed in $SEEDS; do
    for policy in $POLICIES; do
      common=(demo --duration "$DURATION" --rps "$rate" --seed "$seed" --policy "$policy" --json)
      calm=$("$tongs" "${common[@]}" --no-interruptions 2>/dev/null)
      churn=$("$tongs" "${common[@]}" 2>/dev/null)
      python3 - "$rate" "$seed" "$policy" "$calm" "$churn" <<'PY'
import json, sys
rate, seed, policy = sys.argv[1], sys.argv[2], sys.argv[3]
calm, churn = json.loads(sys.argv[4]), json.loads(sys.argv[5])
for name, run in (("calm", calm), ("churn", churn)):
    lat = run["latency_ms"]
    failed = ", ".join(f"{k}: {v}" for k, v in run["failed"].items()) or "0"
    ratio = lat["p99"] / calm["latency_ms"]["p99"] if calm["latency_ms"]["p99"] else 0
    print(f"| {rate} | {seed} | {policy} | {name} | {run['requests']} | {100 * run['succeeded'] / run['requests']:.2f} "
          f"| {failed} | {run['retried']} | {run['attempts_per_request']:.3f} | {lat['p50']:.0f} | {lat['p99']:.0f} "
          f"| {lat['max']:.0f} | {ratio:.2f}x |")
PY
    done
  done
done

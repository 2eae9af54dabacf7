#!/usr/bin/env bash
# Issue 9's figures: Dynamo's indexer workloads (dynamo-w1..w4), each on the one-thread
# index (kv-index) and on the thread-per-core runtime (2 cores), 1 warm-up + 5 timed runs
# per invocation, JSON reports in docs/bench-results/ and one summary line per report.
#
#   bash lab/indexer_anchor/run.sh [workload...]      (default: all four)
#
# Run it on a quiet machine: every figure moves with the memory system of the moment; each
# report records the machine's memory latency (`mem_latency_ns`) measured just before.
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release --locked -p kvengine >/dev/null
out=docs/bench-results
mkdir -p "$out"
workloads=("${@:-dynamo-w1 dynamo-w2 dynamo-w3 dynamo-w4}")
for w in ${workloads[@]}; do
  for ix in "kv-index 1" "runtime 2"; do
    set -- $ix
    json="$out/anchor-$w-$1-$2.json"
    ./target/release/kvengine bench indexer --workload "$w" --indexer "$1" --cores "$2" \
      --warmup 1 --repeat 5 --quiet --json "$json" >/dev/null
    python3 - "$json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
f = lambda k, s=1e6: "/".join(f"{x / s:.1f}" for x in r["range"][k])
print(f'{r["workload"]} {r["indexer"].split("(")[0]}x{r["cores"]}: '
      f'store {f("store_blocks_per_s")} M/s, remove {f("remove_blocks_per_s")} M/s, '
      f'hit p99 {f("hit_p99_us", 1)} us, qps1 {f("hit_qps_1", 1e3)} k, '
      f'B/block {r["bytes_per_block"]:.1f} (computed {r["bytes_per_block_entry"]:.1f}), '
      f'balance {f("shard_balance", 1)}, '
      f'mem 16/128 MB {r["mem_latency_ns"]["16MB"]:.0f}/{r["mem_latency_ns"]["128MB"]:.0f} ns '
      f'(after runs, 16 MB: {"/".join(str(round(x["mem_latency_ns"]["16MB"])) for x in r["runs"])}), '
      f'checks {r["checks_passed"]}')
PY
  done
done

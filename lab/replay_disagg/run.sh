#!/usr/bin/env bash
# Issue 13's figures: disaggregated serving (`kvengine bench replay --disagg P:D`) against
# aggregated kv on the same number of simulated GPUs, five runs each, JSON and SVG per run in
# docs/bench-results/disagg/, then min / median / max tables.
#
#   bash lab/replay_disagg/run.sh
#
# About 10 minutes on 2 cores. Run it on a quiet machine: the simulated workers sleep in
# real time, so a busy CPU stretches their steps.
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release --locked -p kvengine >/dev/null
k=./target/release/kvengine
trace=../shared/data/mooncake/synthetic_trace.jsonl
out=docs/bench-results/disagg
mkdir -p "$out"
for i in 1 2 3 4 5; do
  $k bench replay --disagg 2:2 --max-requests 1000 --speedup 2 \
    --json "$out/chat-2-2-$i.json" --plot "$out/chat-2-2-$i.svg" >/dev/null
  $k bench replay --trace "$trace" --disagg 3:1 --mode kv --max-requests 1000 --speedup 20 \
    --kv-blocks 131072 --json "$out/mooncake-3-1-$i.json" --plot "$out/mooncake-3-1-$i.svg" >/dev/null
  $k bench replay --trace "$trace" --disagg 2:2 --max-requests 1000 --speedup 20 \
    --kv-blocks 131072 --json "$out/mooncake-2-2-$i.json" --plot "$out/mooncake-2-2-$i.svg" >/dev/null
done
python3 - "$out" <<'PY'
import json, statistics, sys
out = sys.argv[1]
for name in ["chat-2-2", "mooncake-3-1", "mooncake-2-2"]:
    runs = [json.load(open(f"{out}/{name}-{i}.json")) for i in range(1, 6)]
    print(f"\n{name} (min / median / max of 5 runs)")
    print("| run | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | output tok/s | cache hit % | remote / local prefills | errors |")
    print("|---|---|---|---|---|---|---|---|---|")
    for li, first in enumerate(runs[0]):
        rs = [run[li] for run in runs]
        def mmm(k, d=0, scale=1):
            v = sorted(r[k] * scale for r in rs)
            return " / ".join(f"{x:.{d}f}" for x in (v[0], statistics.median(v), v[-1]))
        dg = [r.get("disagg") for r in rs]
        split = "-" if not dg[0] else (
            "/".join(str(x["remote_prefills"]) for x in dg) + " ; "
            + "/".join(str(x["local_prefills"]) for x in dg))
        print(f"| {first['mode']} | {mmm('ttft_p50_ms')} | {mmm('ttft_p99_ms')} | "
              f"{mmm('itl_p50_ms', 1)} | {mmm('itl_p99_ms', 1)} | {mmm('output_tok_per_s')} | "
              f"{mmm('cache_hit_rate', 1, 100)} | {split} | {sum(r['errors'] for r in rs)} |")
PY

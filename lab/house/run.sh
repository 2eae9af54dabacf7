#!/usr/bin/env bash
# Issue 30's no-regression check: two release binaries side by side, interleaved (A B A B),
# RUNS rounds of each figure:
#   - POST /v1/route, 8,000-token prompts (lab/http_route/run.sh: wrk, CONNS connections);
#   - ZMQ ingest   (kvengine bench ingest --transport zmq --batches 3000);
#   - QUIC ingest  (kvengine bench ingest --transport quic --batches 10000);
# with memory latency (kvengine bench memlat) before and after. Prints one line per run and
# a min / median / max summary per figure and binary.
#
#   lab/house/run.sh BEFORE_BIN AFTER_BIN      # RUNS=5 CONNS=16 DURATION=8s
set -euo pipefail
cd "$(dirname "$0")/../.."
A=$1
B=$2
RUNS=${RUNS:-5}
CONNS=${CONNS:-16}
DURATION=${DURATION:-8s}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
echo "raw output in $OUT"
"$B" bench memlat 2>&1 | tail -3 | sed 's/^/memlat before: /'

route() { # bin -> "req/s p99"
  BIN=$1 CONNS=$CONNS DURATION=$DURATION PORT=$((8100 + RANDOM % 800)) \
    bash lab/http_route/run.sh >"$OUT/route.$3.$2" 2>&1 || true
  local rps p99
  rps=$(awk '/^Requests\/sec:/ {print $2}' "$OUT/route.$3.$2")
  p99=$(awk '$1 == "99%" {print $2}' "$OUT/route.$3.$2")
  echo "$rps $p99"
}

ingest() { # bin transport batches tag run -> M block events/s
  local json="$OUT/ingest.$2.$4.$5.json"
  "$1" bench ingest --transport "$2" --batches "$3" --json "$json" >"$OUT/ingest.$2.$4.$5.log" 2>&1 || true
  python3 - "$json" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception:
    print("nan"); sys.exit()
def find(v):
    if isinstance(v, dict):
        for k, x in v.items():
            if k in ("block_events_per_s", "events_per_s", "block_events_per_sec") and isinstance(x, (int, float)):
                return x
            f = find(x)
            if f is not None:
                return f
    if isinstance(v, list):
        for x in v:
            f = find(x)
            if f is not None:
                return f
    return None
v = find(r)
print("nan" if v is None else f"{v/1e6:.2f}")
PY
}

for i in $(seq "$RUNS"); do
  for tag in before after; do
    bin=$A; [ "$tag" = after ] && bin=$B
    echo "run $i $tag route $(route "$bin" "$i" "$tag")"
    echo "run $i $tag zmq $(ingest "$bin" zmq 3000 "$tag" "$i")"
    echo "run $i $tag quic $(ingest "$bin" quic 10000 "$tag" "$i")"
  done
done | tee "$OUT/runs.txt"
"$B" bench memlat 2>&1 | tail -3 | sed 's/^/memlat after: /'
python3 - "$OUT/runs.txt" <<'PY'
import sys, statistics
rows = {}
for line in open(sys.argv[1]):
    p = line.split()
    if len(p) < 5: continue
    _, _, tag, fig, *vals = p
    rows.setdefault((fig, tag), []).append(vals)
def mmm(xs):
    xs = sorted(x for x in xs if x == x)
    return "n/a" if not xs else f"{xs[0]:g} / {statistics.median(xs):g} / {xs[-1]:g}"
def num(s):
    s = s.strip()
    mul = 1.0
    for suf, m in (("us", 1e-3), ("ms", 1.0), ("s", 1e3)):
        if s.endswith(suf):
            return float(s[: -len(suf)]) * m
    try: return float(s)
    except ValueError: return float("nan")
for fig in ("route", "zmq", "quic"):
    for tag in ("before", "after"):
        v = rows.get((fig, tag), [])
        if fig == "route":
            print(f"{fig:6} {tag:6} req/s {mmm([num(x[0]) for x in v])}   p99 ms {mmm([num(x[1]) for x in v if len(x) > 1])}")
        else:
            print(f"{fig:6} {tag:6} M block events/s {mmm([num(x[0]) for x in v])}")
PY

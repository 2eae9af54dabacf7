#!/usr/bin/env bash
# End-to-end load test of POST /v1/route on the real router: starts `kvengine` (the release
# binary), registers 8 workers and preloads their caches over HTTP (preload.py), then
# drives /v1/route with wrk (route.lua: 8,000-token prompts, ~50 KB bodies).
#
#   lab/http_route/run.sh     # PORT=8088 DURATION=10s CONNS=16 THREADS=1 CORES=2
#
# BIN=path/to/kvengine runs that binary instead of building this checkout's (to compare two
# commits side by side on the same day).
#
# HTTP runs on the core threads; HTTP_THREADS=N selects the comparison layout instead (HTTP
# on N threads of its own, cores on theirs; see docs/architecture.md).
#
# Requests are never freed by the load generator; --request-timeout-secs 2 expires them
# so the active set stays bounded, and the per-client reservation cap is off
# (KVENGINE_MAX_RESERVATIONS_PER_CLIENT=0: wrk is one client holding thousands; an older
# binary ignores the variable). Prints wrk's report and the router's RSS.
set -euo pipefail
cd "$(dirname "$0")/../.."
PORT=${PORT:-8088}
DURATION=${DURATION:-10s}
CONNS=${CONNS:-16}
THREADS=${THREADS:-1}
CORES=${CORES:-2}
HTTP_THREADS=${HTTP_THREADS:-}
EXTRA=${EXTRA:-}
BIN=${BIN:-}

if [ -z "$BIN" ]; then
  cargo build --release -q -p kvengine
  BIN=target/release/kvengine
fi
LAYOUT=()
[ -n "$HTTP_THREADS" ] && LAYOUT=(--http-threads "$HTTP_THREADS")
KVENGINE_MAX_RESERVATIONS_PER_CLIENT=0 "$BIN" --cores "$CORES" "${LAYOUT[@]}" --http-host 127.0.0.1 \
  --http-port "$PORT" --request-timeout-secs 2 $EXTRA >/dev/null 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null || true' EXIT
for _ in $(seq 100); do
  curl -sf "http://127.0.0.1:$PORT/healthz" >/dev/null && break
  sleep 0.1
done
python3 lab/http_route/preload.py "http://127.0.0.1:$PORT"
rss() { awk '/VmRSS/ {print $2 " kB"}' "/proc/$PID/status"; }
echo "router RSS before: $(rss)"
# Warm-up (thread-local buffers, connection pools, allocator).
wrk -t"$THREADS" -c"$CONNS" -d2s -s lab/http_route/route.lua "http://127.0.0.1:$PORT/v1/route" >/dev/null
wrk -t"$THREADS" -c"$CONNS" -d"$DURATION" -s lab/http_route/route.lua --latency \
  "http://127.0.0.1:$PORT/v1/route"
echo "router RSS after: $(rss)"
curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^kvengine_(active_requests|decisions_total\{mode="kv"\})'

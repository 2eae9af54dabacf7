#!/usr/bin/env bash
# End-to-end load test of POST /v1/route: starts transport/examples/http_edge (2-core
# engine, 8 workers, preloaded prefixes, 2 tokio worker threads) and drives it with wrk.
#
#   benches/http_route/run.sh            # PORT=8088 DURATION=10s CONNS=32 THREADS=1
#
# Prints wrk's report (requests/s, latency percentiles) and the server's RSS before and
# after the run.
set -euo pipefail
cd "$(dirname "$0")/../.."
PORT=${PORT:-8088}
DURATION=${DURATION:-10s}
CONNS=${CONNS:-32}
THREADS=${THREADS:-1}
TIMEOUT_SECS=${TIMEOUT_SECS:-2}

cargo build --release -q -p kvengine-transport --example http_edge
target/release/examples/http_edge "$PORT" "$TIMEOUT_SECS" &
PID=$!
trap 'kill $PID 2>/dev/null || true' EXIT
for _ in $(seq 100); do
  curl -sf "http://127.0.0.1:$PORT/healthz" >/dev/null && break
  sleep 0.1
done
rss() { awk '/VmRSS/ {print $2 " kB"}' "/proc/$PID/status"; }
echo "server RSS before: $(rss)"
# Warm-up (thread-local buffers, connection pools, allocator).
wrk -t"$THREADS" -c"$CONNS" -d2s -s benches/http_route/route.lua "http://127.0.0.1:$PORT/v1/route" >/dev/null
wrk -t"$THREADS" -c"$CONNS" -d"$DURATION" -s benches/http_route/route.lua --latency \
  "http://127.0.0.1:$PORT/v1/route"
echo "server RSS after: $(rss)"
curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^kvengine_(active_requests|decisions_total)'

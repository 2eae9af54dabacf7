#!/usr/bin/env bash
# The real-vLLM conformance suite: two vLLM CPU servers, kvengine in front, an independent
# oracle built from the raw ZMQ KV events. It never skips: a missing venv is created, a
# failed setup or server start is a failure. See conformance/README.md.
#
#   bash conformance/run_vllm.sh
#
# Env: KVENGINE_BIN (skip the cargo build), KVENGINE_CONFORMANCE_WORKDIR (logs; default a
# temp dir, kept), KVENGINE_RECORD_FIXTURES=1 (write transport/tests/data/vllm-0.32.0/observed_*),
# KVENGINE_CONFORMANCE_ROUTER_RESTARTS=N (only step 1 and N router restarts under traffic:
# the restart figure of docs/benchmarks.md, "Issue 28").
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)

# 1. the virtualenv (one install at a time: a concurrent run waits on the lock)
cache=${KVENGINE_VENV_CACHE:-$HOME/.cache/kvengine}
mkdir -p "$cache"
venv=$(flock "$cache/.setup.lock" bash "$here/setup_vllm.sh")
[ -f "$venv/.ready" ] || { echo "virtualenv $venv is not ready" >&2; exit 1; }
py="$venv/bin/python"

# 2. kvengine
if [ -n "${KVENGINE_BIN:-}" ]; then
  bin=$KVENGINE_BIN
else
  (cd "$repo" && cargo build -p kvengine --locked)
  bin="$repo/target/debug/kvengine"
fi
[ -x "$bin" ] || { echo "no kvengine binary at $bin" >&2; exit 1; }

# 3. the tiny model
workdir=${KVENGINE_CONFORMANCE_WORKDIR:-$(mktemp -d -t kvengine-conformance-XXXXXX)}
mkdir -p "$workdir"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
"$py" "$here/make_model.py" "$workdir/model"

# 4-6. servers, kvengine and the scenario (the suite owns and always kills its processes)
fixtures=()
if [ "${KVENGINE_RECORD_FIXTURES:-0}" = 1 ]; then
  fixtures=(--fixtures "$repo/transport/tests/data/vllm-0.32.0")
else
  fixtures=(--fixtures "$workdir/fixtures")
fi
exec "$py" -u "$here/vllm_suite.py" --kvengine "$bin" --model "$workdir/model" \
  --python "$py" --workdir "$workdir" "${fixtures[@]}" \
  --router-restarts "${KVENGINE_CONFORMANCE_ROUTER_RESTARTS:-0}"

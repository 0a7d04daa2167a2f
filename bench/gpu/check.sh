#!/usr/bin/env bash
# The one-call GPU check: on a bare GPU machine (CUDA torch + transformers, no network, no vLLM),
# install what hfrt and TRL need from bench/gpu/wheels/ (made here by bench/gpu/wheels.sh), then run
# every part of bench/gpu_check.py inside 9 minutes in all and write one JSON file into $OUT (or
# --out DIR). A part that fails is recorded and the rest go on.
#   bench/gpu/check.sh                 # on the GPU machine, from the repository root
#   bench/gpu/check.sh --cpu --out /tmp/gpu-check   # the same parts on the CPU with a tiny model
# Environment: PYTHON (default python3), CHECK_BUDGET_S (default 540: the whole check, install included).
set -uo pipefail
start=$(date +%s)
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
cd "$root"
py=${PYTHON:-python3}
budget=${CHECK_BUDGET_S:-540}

# 1. wheels carried along (skipped where everything is importable already, e.g. the dev venv)
if ! "$py" -c "import zmq, msgpack, structlog, trl, peft, pytest_asyncio" 2>/dev/null; then
    if [ -d "$here/wheels" ]; then
        echo "[gpu-check] installing from $here/wheels" >&2
        timeout 60 "$py" -m pip install --quiet --no-index --find-links "$here/wheels" -r "$here/requirements.txt" >&2 \
            || echo "[gpu-check] install from wheels failed (parts needing them will fail and be recorded)" >&2
    else
        echo "[gpu-check] no $here/wheels (run bench/gpu/wheels.sh where PyPI is reachable); going on" >&2
    fi
fi

# 2. hfrt importable without installing it: a folder whose hfrt/ links the package's pieces
#    (hfrt.roles is roles/, hfrt.bench is bench/, ... as pyproject.toml maps them)
if ! "$py" -c "import hfrt.bench.gpu_check" 2>/dev/null; then
    shim=$(mktemp -d /tmp/hfrt-shim-XXXX)
    mkdir "$shim/hfrt"
    for entry in "$root"/hfrt/*; do ln -s "$entry" "$shim/hfrt/"; done
    for piece in roles protocols deploy bench; do ln -s "$root/$piece" "$shim/hfrt/$piece"; done
    export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}"
fi

left=$(( budget - ($(date +%s) - start) - 10 ))
exec "$py" -m hfrt.bench.gpu_check --budget-s "$left" "$@"

#!/usr/bin/env bash
# Download the wheels the one-call GPU check (bench/gpu/check.sh) installs offline, into
# bench/gpu/wheels/ (ignored by git; carried to the GPU machine with the working tree).
# Usage: bench/gpu/wheels.sh [PYTHON_VERSION]   (default 3.12: the lent H100/H200 hosts' python)
# Wheels of packages a CUDA torch + transformers install already has (numpy, pyyaml, requests,
# huggingface-hub, tokenizers, safetensors, ...) are left out to keep the folder under the 64 MiB
# the device tool carries; pip on the GPU machine resolves against what is installed there.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
pyver=${1:-3.12}
dest="$here/wheels"
mkdir -p "$dest"
pip=${PIP:-"$here/../../.venv/bin/python -m pip"}
$pip download --quiet --dest "$dest" --only-binary=:all: --no-deps \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --python-version "$pyver" --implementation cp \
    -r "$here/requirements.txt" \
    pluggy iniconfig dill multiprocess xxhash "fsspec[http]" aiohttp aiosignal aiohappyeyeballs frozenlist \
    multidict propcache yarl attrs python-dateutil pytz tzdata httpx httpcore h11 anyio sniffio
du -sh "$dest"
ls "$dest" | wc -l

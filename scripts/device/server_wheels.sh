#!/usr/bin/env bash
# The wheels of tokenmill's server and benchmark dependencies that the GPU machine lacks, into .whl/srv of
# the repository (ignored by git), for Python 3.12 on x86-64 Linux: the device scripts install them from
# there when `import fastapi, uvicorn, orjson, uvloop` fails (carry .whl). `python -m tokenmill.bench`
# imports the server's JSON (orjson) and event loop (uvloop) too, and the gpu-marked tests' modules import
# jsonschema (tests/test_structured_output.py). Run here, from the repository root:
#   bash scripts/device/server_wheels.sh
set -euo pipefail
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl/srv
platform=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# with their own dependencies resolved for that machine
python3 -m pip download -q "${platform[@]}" -d .whl/srv fastapi uvicorn pydantic openai jsonschema 2>&1 | grep -v 'is ignored' || true
# compiled ones, alone
python3 -m pip download -q --no-deps "${platform[@]}" -d .whl/srv orjson httptools uvloop 2>&1 | grep -v 'is ignored' || true
# what the machine has already (its versions stay as they are)
(cd .whl/srv && rm -f torch-* triton-* numpy-* tokenizers-* safetensors-* httpx-* httpcore-* anyio-* idna-* \
  certifi-* h11-* click-* typing_extensions-* tqdm-* jinja2-* markupsafe-* prometheus_client-*)
ls .whl/srv
du -sh .whl/srv

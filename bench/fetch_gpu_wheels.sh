#!/usr/bin/env bash
# Download the pure-Python (and small binary) wheels bench/gpu_check.sh needs on a GPU host with
# Python 3.12 and torch but nothing else of ours, into .gpu-wheels/ (git-ignored, ~5 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --dest .gpu-wheels --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --implementation cp \
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types typing-extensions typing-inspection \
  pyyaml==6.0.4
du -sh .gpu-wheels

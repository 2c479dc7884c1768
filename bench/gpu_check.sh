#!/usr/bin/env bash
# GPU check (bench/gpu_check.py; DESIGN.md 6-7): the device against the CPU from identical
# weights (every table row held to its bound), then plain and VR at 8 x 64k rows a step,
# model-bound and end to end (the input pipeline from generated day files and from live
# synthetic data): rows/s, data_wait_s and peak GPU memory in one table; where a step's time
# goes; NVIDIA's DLRM shape per precision. On FBGEMM's tables where fbgemm_gpu and torchrec
# import (docs/deployment.md: which FBGEMM goes with which torch), else the pure-PyTorch ones.
# At most 8 minutes on one H200.
#
#   bash bench/gpu_check.sh                 # on the GPU host (default --device cuda)
#   bash bench/gpu_check.sh --device cpu    # the CPU form of the same code paths (small sizes)
#
# Our few pure-Python dependencies (pydantic, pyyaml, ...) are installed from a local wheel
# folder when they are missing: bench/fetch_gpu_wheels.sh fills .gpu-wheels/ for Python 3.12
# (pass it along to the host, e.g. the device tool's `carry: [".gpu-wheels"]`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ "${1:-}" = "--device" ] && [ "${2:-}" = "cpu" ] && [ -x .venv/bin/python ]; then
  PY=.venv/bin/python
fi
if ! "$PY" -c "import pydantic, yaml, numpy" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --find-links .gpu-wheels pydantic pyyaml numpy
fi
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(--device cuda)
[ "${args[1]:-}" = "cpu" ] && args+=(--quick)
exec "$PY" bench/gpu_check.py "${args[@]}"

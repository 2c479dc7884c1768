#!/usr/bin/env bash
# One GPU allocation of the pre-registered study (docs/study/gpu_512k/PREREGISTRATION.md):
# generate the day files when this host has none, then run the study's cells within what is
# left of the allocation, bringing back the bundle (at most 8 files) in OUT.
#
#   bash docs/study/gpu_512k/allocation.sh "$OUT"          # from the repository root
#
# Environment: ALLOCATION_S (default 540: the command's limit less a minute), PYTHON (default
# python3, with the CUDA stack of DESIGN.md 7 importable, e.g. PYTHONPATH=/tmp/site after
# ../shared/gpu/unpack.sh), GEN_WORKERS (default: every core).
# Afterwards, where the repository is committed: copy OUT's files into docs/study/gpu_512k/,
# `dlrm-vrgd study report docs/study/gpu_512k`, commit; the next allocation resumes from them.
set -euo pipefail
OUT=${1:?usage: allocation.sh OUT_DIR}
START=$(date +%s)
ALLOCATION_S=${ALLOCATION_S:-540}
PY=${PYTHON:-python3}
cd "$(dirname "$0")/../../.."
mkdir -p "$OUT"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'"
if [ ! -f data/study_gpu_512k/manifest.json ]; then
  # 16,777,216 training rows in 4 days, 1M validation and 1M test rows, with their true click
  # probabilities (the oracle's AUC is in the manifest); the same rows on every host
  "$PY" -m dlrm_vrgd.cli generate --config configs/study_gpu_512k_data.yaml \
    --out data/study_gpu_512k --rows-per-day 4194304 --no-progress \
    ${GEN_WORKERS:+--workers "$GEN_WORKERS"} | tee "$OUT/generate.log"
fi
LEFT=$(( ALLOCATION_S - ($(date +%s) - START) ))
if [ "$LEFT" -lt 60 ]; then
  echo "only ${LEFT} s left after generating the data: no cell started" >&2
  exit 0
fi
exec "$PY" -m dlrm_vrgd.cli study --config configs/study_gpu_512k.yaml \
  --out docs/study/gpu_512k --budget-s "$LEFT" --bundle "$OUT"

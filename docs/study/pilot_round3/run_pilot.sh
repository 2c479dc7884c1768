#!/bin/bash
# The pilot's two runs, one after the other (see configs/study_pilot_round3.yaml).
set -e
cd "$(dirname "$0")/../../.."
dlrm-vrgd study --config configs/study_pilot_round3.yaml --out docs/study/pilot_round3/s1.6
dlrm-vrgd study --config configs/study_pilot_round3.yaml --set base.data.signal_scale=3.0 \
  --out docs/study/pilot_round3/s3.0

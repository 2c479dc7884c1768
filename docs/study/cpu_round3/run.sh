#!/bin/bash
# Round three in the background, resumable: finish the pilot (a no-op once it is done), copy the
# pilot's SGD cells that round three's stage 1 shares (the same configs: the runner checks), then
# run round three. Start (from the repository root, in the project's environment):
#   setsid nohup nice -n 19 docs/study/cpu_round3/run.sh > runs/study_cpu_round3.log 2>&1 &
# The same command resumes after an interruption: finished cells are never rerun.
set -euo pipefail
cd "$(dirname "$0")/../../.."
pilot=docs/study/pilot_round3/s1.6
out=docs/study/cpu_round3
# another runner may still be finishing the pilot in this directory: wait for it
while pgrep -f -- "--out $pilot\$" > /dev/null; do sleep 60; done
# the pilot's 4,096 cells at x0.25 and x0.5 first (its earliest degradation estimate), then the rest
mkdir -p "$pilot/cells"
dlrm-vrgd study --config configs/study_pilot_round3.yaml --set 'batch_sizes=[4096]' \
  --set 'lr_multipliers=[0.25, 0.5]' --set rule_multiplier=0.5 --out "${pilot}_4096"
for cell in "${pilot}_4096"/cells/*; do
  [ -e "$pilot/cells/$(basename "$cell")" ] || cp -r "$cell" "$pilot/cells/"
done
dlrm-vrgd study --config configs/study_pilot_round3.yaml --out "$pilot"
python - "$pilot" "$out" <<'PY'
import json, shutil, sys
from pathlib import Path
from dlrm_vrgd.study.config import load_study
from dlrm_vrgd.study.protocol import plan
from dlrm_vrgd.study.run import _untracked
pilot, out = Path(sys.argv[1]), Path(sys.argv[2])
study = load_study("configs/study_cpu_round3.yaml")
for cell in plan(study, {}).tune_cells + [c for c in study.cells() if c.global_batch != 512]:
    src, dst = pilot / "cells" / cell.id, out / "cells" / cell.id
    if dst.exists() or not (src / "result.json").exists():
        continue
    mine = json.loads(json.dumps(study.cell_config(cell).to_dict()))
    if _untracked(json.loads((src / "config.json").read_text())) == _untracked(mine):
        shutil.copytree(src, dst)
        print(f"copied the pilot's {cell.id}")
PY
dlrm-vrgd study --config configs/study_cpu_round3.yaml --out "$out"

"""The run directory's layout (DESIGN.md 5): the names of what a run writes.

```
OUT/
  config.json      the resolved TrainConfig (atomic)
  metrics.jsonl    one JSON object per line: step records and eval records (append-only)
  gsnr.jsonl       per-step GSNR summaries per tensor / table (append-only)
  checkpoints/     step_XXXXXXXX/ directories, each complete or absent (see dlrm_vrgd.checkpoint)
  result.json      final metrics, config, versions, timings (atomic; present = run finished)
  status.json      written (atomically) when a run ends with an error: state, step, error
```

``metrics.jsonl`` starts with a ``kind: start`` record (total_steps, start_step, batch layout).

How each file is written (atomically, or append-only): :mod:`dlrm_vrgd.rundir.files`.
"""

from __future__ import annotations

CONFIG = "config.json"
METRICS = "metrics.jsonl"
GSNR = "gsnr.jsonl"
RESULT = "result.json"
STATUS = "status.json"
CHECKPOINTS = "checkpoints"

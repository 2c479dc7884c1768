"""dlrm-vrgd: a TorchRec DLRM trainer with VRGD optimizers, and its job service."""

import os

# OpenMP's worker threads spin while they wait for work (OMP_WAIT_POLICY=ACTIVE is libgomp's
# way): on a machine whose cores other processes share, every parallel region then waits for a
# thread that holds no core, ~1 s a micro-batch of a small model at load 3-8 on 2 cores (the
# Criteo guide trained at 241-316 rows/s; passive waiting: 7.6k-10.5k). Passive waiting costs
# little on idle cores. It must be set before torch (libgomp) loads; an explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

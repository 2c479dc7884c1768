"""``python -m dlrm_vrgd.cli``: what torchrun runs on every rank (train/distributed.py)."""

import sys

from dlrm_vrgd.cli import main

sys.exit(main())

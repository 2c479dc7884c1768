"""Run every benchmark in turn (``make bench``), each printing its own table and ratios.

python bench/run_all.py [--only NAME ...]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHES = {
    "gsnr_overhead": [sys.executable, str(HERE / "gsnr_overhead.py")],
    "tracking_overhead": [sys.executable, str(HERE / "tracking_overhead.py")],
    "sparse_step": [sys.executable, str(HERE / "sparse_step.py")],
    "throughput": [sys.executable, str(HERE / "throughput.py")],
    "memory": [sys.executable, str(HERE / "memory.py")],
    "preprocess": [sys.executable, str(HERE / "preprocess.py")],
    "service_load": [sys.executable, str(HERE / "service_load.py")],
    "gpu_check_cpu": ["bash", str(HERE / "gpu_check.sh"), "--device", "cpu"],
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", choices=sorted(BENCHES), help="run just these")
    args = ap.parse_args()
    failed = []
    for name in args.only or BENCHES:
        print(f"\n=== {name} " + "=" * (60 - len(name)), flush=True)
        t0 = time.perf_counter()
        code = subprocess.run(BENCHES[name], cwd=HERE).returncode
        print(f"--- {name}: exit {code}, {time.perf_counter() - t0:.0f} s", flush=True)
        if code:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

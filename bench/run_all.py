"""Run every benchmark in turn (``make bench``), each printing its own table and ratios.

With ``--save bench/results/<date>.json`` the run is kept: the machine and its load (cpu count,
load averages before and after, Python and torch versions), and per bench its exit status, its
arguments, and the figures of the benches that write them (``--json``: memory, sparse_step,
throughput, input). docs/benchmarks.md quotes its figures from such a file, and
tests/test_bench_results.py checks every quoted figure against it.

    python bench/run_all.py [--only NAME ...] [--save PATH] [--set NAME=ARGS ...]

``--set throughput='--reps 9'`` passes arguments to one bench (saved with its figures).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import machine

HERE = Path(__file__).resolve().parent
BENCHES = {
    "gsnr_overhead": [sys.executable, str(HERE / "gsnr_overhead.py")],
    "tracking_overhead": [sys.executable, str(HERE / "tracking_overhead.py")],
    "sparse_step": [sys.executable, str(HERE / "sparse_step.py")],
    "throughput": [sys.executable, str(HERE / "throughput.py")],
    "input": [sys.executable, str(HERE / "input.py")],
    "memory": [sys.executable, str(HERE / "memory.py")],
    "preprocess": [sys.executable, str(HERE / "preprocess.py")],
    "service_load": [sys.executable, str(HERE / "service_load.py")],
    "gpu_check_cpu": ["bash", str(HERE / "gpu_check.sh"), "--device", "cpu"],
}
#: benches that write their figures with ``--json PATH``
WRITES_JSON = {"memory", "sparse_step", "throughput", "input"}


def parse_sets(items: list[str]) -> dict[str, list[str]]:
    out = {}
    for item in items:
        name, sep, args = item.partition("=")
        if not sep or name not in BENCHES:
            raise SystemExit(
                f"--set {item!r}: expected NAME=ARGS with NAME one of {sorted(BENCHES)}"
            )
        out[name] = shlex.split(args)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", choices=sorted(BENCHES), help="run just these")
    ap.add_argument("--save", type=Path, help="keep the run as JSON (bench/results/<date>.json)")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=ARGS")
    args = ap.parse_args()
    extra = parse_sets(args.set)
    if args.save is not None and not args.save.parent.is_dir():
        raise SystemExit(f"--save {args.save}: no directory {args.save.parent}")
    saved: dict[str, object] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "benches": {},
    }
    failed = []
    with tempfile.TemporaryDirectory(prefix="dlrm-vrgd-bench-") as tmp:
        for name in args.only or BENCHES:
            print(f"\n=== {name} " + "=" * (60 - len(name)), flush=True)
            cmd = BENCHES[name] + extra.get(name, [])
            out = Path(tmp) / f"{name}.json"
            if args.save is not None and name in WRITES_JSON:
                cmd = [*cmd, "--json", str(out)]
            t0 = time.perf_counter()
            code = subprocess.run(cmd, cwd=HERE).returncode
            seconds = time.perf_counter() - t0
            print(f"--- {name}: exit {code}, {seconds:.0f} s", flush=True)
            if code:
                failed.append(name)
            entry: dict[str, object] = {
                "exit": code,
                "seconds": round(seconds, 1),
                "args": extra.get(name, []),
            }
            if out.exists():
                entry.update(json.loads(out.read_text()))
            saved["benches"][name] = entry  # type: ignore[index]
    saved["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    saved["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    if args.save is not None:
        tmp_path = args.save.with_suffix(".tmp")
        tmp_path.write_text(json.dumps(saved, indent=1) + "\n")
        tmp_path.replace(args.save)
        print(f"saved {args.save}")
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

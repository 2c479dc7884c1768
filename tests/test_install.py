"""``pip install dlrm-vrgd`` without extras (issue 47, a light install): a wheel of the project,
installed into a fresh virtual environment beside the CPU torch stack the way ``make setup``
installs it (requirements/cpu-stack.txt, torchrec with --no-deps, requirements/constraints.txt),
trains torchrec's own DLRM with ``examples/torchrec_dlrm.py``; a service command there names the
extra to install instead of a traceback.

It installs from the index pip is configured with (pip.conf, PIP_* variables), as ``make setup``
does; pip's cache makes the torch wheel a copy. About 35 s on two cores with a warm cache (19 s
of it the installs)."""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: What the wheel is built from (copied, so that the build writes nothing into the checkout).
SOURCES = ("pyproject.toml", "README.md", "dlrm_vrgd", "service")
#: The extras' modules: none may come with the bare install.
EXTRA_MODULES = ("fastapi", "uvicorn", "sqlalchemy", "httpx", "matplotlib", "onnx", "mlflow")


def _run(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert out.returncode == 0, f"{' '.join(map(str, cmd))}: exit {out.returncode}\n" + (
        out.stdout[-3000:] + out.stderr[-3000:]
    )
    return out


def test_wheel_without_extras_runs_the_torchrec_example(tmp_path: Path) -> None:
    t0 = time.monotonic()
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / name)
    # the checkout's setuptools: no build environment to install
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(src)],
        timeout=300,
    )  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("dlrm_vrgd-*.whl")

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], timeout=120)
    py = str(venv / "bin" / "python")
    pip = [py, "-m", "pip", "--disable-pip-version-check", "install", "-q", "--no-compile"]
    pin = ["-c", str(ROOT / "requirements" / "constraints.txt")]
    # as `make setup`: the CPU stack and the project (its dependencies pinned), then torchrec
    # without its dependencies (its metadata asks for the CUDA fbgemm-gpu)
    _run(
        pip + pin + ["--no-warn-conflicts", "-r", str(ROOT / "requirements" / "cpu-stack.txt"),
                     str(wheel)],
        timeout=900,
    )  # fmt: skip
    _run(pip + pin + ["--no-deps", "-r", str(ROOT / "requirements" / "torchrec.txt")], timeout=300)
    installed = time.monotonic() - t0

    # nothing of the extras came with it
    probe = f"import importlib.util as u; print([m for m in {EXTRA_MODULES!r} if u.find_spec(m)])"
    assert _run([py, "-c", probe], timeout=60).stdout.strip() == "[]"

    # the example, from outside the checkout: the installed wheel, not the sources
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    out = _run(
        [py, str(ROOT / "examples" / "torchrec_dlrm.py")], timeout=300, cwd=tmp_path, env=env
    )
    text = out.stdout + out.stderr
    match = re.findall(r"final loss: (\S+)", text)
    assert match, text[-2000:]
    assert math.isfinite(float(match[-1])), text[-2000:]
    assert (
        str(venv)
        in _run(
            [py, "-c", "import dlrm_vrgd; print(dlrm_vrgd.__file__)"],
            timeout=60,
            cwd=tmp_path,
            env=env,
        ).stdout
    )

    # a service command names its extra (exit 2), not a traceback
    cli = str(venv / "bin" / "dlrm-vrgd")
    for argv in (["serve"], ["demo"], ["jobs", "list"]):
        res = subprocess.run(
            [cli, *argv], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env
        )
        assert res.returncode == 2, (argv, res.stdout, res.stderr)
        assert (
            f"error: dlrm-vrgd {argv[0]} needs the service extra: "
            "pip install 'dlrm-vrgd[service]'" in res.stderr
        ), res.stderr
        assert "Traceback" not in res.stderr
    print(f"installed in {installed:.0f} s; all in {time.monotonic() - t0:.0f} s")

"""The light install (issue 47): the service, ONNX, tracking and study stacks are extras.

- ``import dlrm_vrgd.optim`` (and the trainer, and the CLI) loads none of them;
- a command that needs a missing extra says which (exit 2), through the real CLI, with the
  extra's modules made unimportable by a ``sitecustomize`` meta-path hook;
- the trainer runs with every extra missing;
- pyproject.toml's extras are the ones the CLI names, and the core dependencies hold none of
  their packages."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
import yaml

from dlrm_vrgd.cli import main
from dlrm_vrgd.cli.common import EXTRAS, MissingExtra, extra_of
from tests.conftest import tiny_config_dict

ROOT = Path(__file__).resolve().parents[1]
#: The heavy stacks issue 47 names: none may load with the optimizers or the trainer.
HEAVY = ("fastapi", "uvicorn", "sqlalchemy", "matplotlib", "onnx", "onnxruntime", "mlflow")
ALL_EXTRA_MODULES = tuple(m for modules in EXTRAS.values() for m in modules)

#: Each blocked module as if not installed: ``import`` raises ModuleNotFoundError and
#: ``importlib.util.find_spec`` answers None (a None in sys.modules does both).
BLOCKER = """
import os, sys

for name in os.environ["DLRM_VRGD_TEST_BLOCK"].split(","):
    sys.modules[name] = None
"""


def _loaded(module: str) -> list[str]:
    code = f"import sys, {module}; print(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@pytest.mark.parametrize("module", ["dlrm_vrgd.optim", "dlrm_vrgd.train.run", "dlrm_vrgd.cli"])
def test_import_loads_no_extra(module: str) -> None:
    assert _loaded(module) == []


def _cli(tmp_path: Path, blocked: tuple[str, ...], *argv: str) -> subprocess.CompletedProcess:
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(textwrap.dedent(BLOCKER))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(hook), str(ROOT)]))
    env["DLRM_VRGD_TEST_BLOCK"] = ",".join(blocked)
    return subprocess.run(
        [sys.executable, "-m", "dlrm_vrgd.cli", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )


def _commands(tmp: Path) -> list[tuple[str, str, list[str]]]:
    """(extra, the command as the message names it, argv): every extra-backed command."""
    run, out = str(tmp / "run"), str(tmp / "model")
    return [
        ("service", "serve", ["serve", "--port", "0"]),
        ("service", "demo", ["demo"]),
        ("service", "jobs", ["jobs", "list"]),
        (
            "onnx",
            "export --format onnx",
            ["export", "--run", run, "--out", out, "--format", "onnx"],
        ),
        ("onnx", "export --format all", ["export", "--run", run, "--out", out, "--format", "all"]),
        ("tracking", "export --mlflow", ["export", "--run", run, "--out", out, "--mlflow"]),
        (
            "onnx",
            "score --engine onnxruntime",
            [
                "score",
                "--model",
                out,
                "--input",
                run,
                "--out",
                str(tmp / "p.csv"),
                "--engine",
                "onnxruntime",
            ],
        ),  # fmt: skip
        ("study", "study", ["study", "--config", str(tmp / "study.yaml")]),
        ("study", "study", ["study", "report", str(tmp / "study")]),
    ]


@pytest.mark.parametrize("i", range(len(_commands(Path("/")))))
def test_command_names_its_missing_extra(tmp_path: Path, i: int) -> None:
    extra, named, argv = _commands(tmp_path)[i]
    proc = _cli(tmp_path, EXTRAS[extra], *argv)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    want = f"error: dlrm-vrgd {named} needs the {extra} extra: pip install 'dlrm-vrgd[{extra}]'"
    assert want in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "model").exists()  # refused before anything is written


def test_train_runs_without_any_extra(tmp_path: Path) -> None:
    """The trainer's own path (train: data, model, VRGD, TensorBoard records, checkpoints)
    with every extra's modules unimportable."""
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config_dict()))
    proc = _cli(
        tmp_path,
        ALL_EXTRA_MODULES,
        "train", "--config", str(cfg), "--out", str(tmp_path / "run"), "--set", "run.steps=4",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "run" / "result.json").exists()


def test_score_auto_names_the_onnx_extra(monkeypatch, capsys, tmp_path: Path) -> None:
    """``score`` with ``--engine auto`` picks onnxruntime for a model with model.onnx: where it
    is missing, the message names the extra and the torch engine."""
    import dlrm_vrgd.serve.score as score_mod

    def score(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'onnxruntime'", name="onnxruntime")

    monkeypatch.setattr(score_mod, "score", score)
    argv = ["score", "--model", str(tmp_path), "--input", str(tmp_path), "--out", "p.csv"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "error: dlrm-vrgd score needs the onnx extra: pip install 'dlrm-vrgd[onnx]'" in err
    assert "--engine torch" in err


def test_extra_of() -> None:
    assert extra_of(ModuleNotFoundError("x", name="fastapi.responses")) == "service"
    assert extra_of(ModuleNotFoundError("x", name="onnxruntime")) == "onnx"
    assert extra_of(MissingExtra("study", "study")) == "study"
    try:
        try:
            raise ModuleNotFoundError("x", name="mlflow")
        except ImportError as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        assert extra_of(outer) == "tracking"
    # not an extra's module: main lets it through as the bug it is
    assert extra_of(ModuleNotFoundError("x", name="torchrec")) is None
    assert extra_of(ImportError("cannot import name 'x'")) is None


def _name(requirement: str) -> str:
    for sep in "<>=![; ":
        requirement = requirement.split(sep)[0]
    return requirement.lower().replace("_", "-")


def test_pyproject_extras_match_the_cli() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert set(EXTRAS) <= set(extras)
    core = {_name(r) for r in project["dependencies"]}
    for extra in EXTRAS:
        packages = {_name(r) for r in extras[extra]}
        assert packages and not packages & core, (extra, packages & core)
    heavy = {"fastapi", "uvicorn", "sqlalchemy", "httpx", "pydantic-settings", "matplotlib"}
    assert not core & (heavy | {"onnx", "onnxscript", "onnxruntime", "mlflow-skinny"})
    assert extras["all"] == [f"dlrm-vrgd[{','.join(EXTRAS)}]"]
    # make setup installs every extra
    makefile = (ROOT / "Makefile").read_text()
    assert f'-e ".[dev,docs,{",".join(EXTRAS)}]"' in makefile

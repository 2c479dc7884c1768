"""No code of the project unpickles a file (issue 24, case 1 and its class), read from the source
with ``ast``: in every ``.py`` under ``dlrm_vrgd/``, ``service/`` and ``bench/``

- every ``torch.load`` passes ``weights_only=True`` (a literal);
- ``torch.export.load`` and ``torch.jit.load`` (they unpickle parts of a file) appear only in
  ``dlrm_vrgd.serve.model.load_program``, which nothing there calls (docs/security.md);
- ``numpy.load`` never passes ``allow_pickle=True``; ``yaml`` is read with ``safe_load`` only;
- nothing imports ``pickle``, ``cPickle``, ``dill``, ``cloudpickle``, ``joblib``, ``marshal``
  or ``shelve``.

``python tests/test_no_unpickling.py [ROOT]`` prints the violations of another checkout.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dlrm_vrgd", "service", "bench")
UNPICKLERS = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}
#: (file, function) where an unpickling loader of torch may be called.
PROGRAM_LOADER = ("dlrm_vrgd/serve/model.py", "load_program")


def _dotted(node: ast.expr) -> str:
    """``a.b.c`` of an attribute chain (``""`` for anything else)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def file_violations(path: Path, rel: str) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[str] = []
    # the function each node is in (for the one allowed program loader)
    owner: dict[int, str] = {}
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            for node in ast.walk(fn):
                owner.setdefault(id(node), fn.name)  # outermost first: ast.walk is BFS
    for node in ast.walk(tree):
        where = f"{rel}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in UNPICKLERS:
                    found.append(f"{where}: imports {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module.split(".")[0] in UNPICKLERS:
                found.append(f"{where}: imports from {module}")
            if module in ("torch", "torch.export", "torch.jit", "numpy", "yaml") and any(
                a.name in ("load", "unsafe_load", "full_load") for a in node.names
            ):
                found.append(f"{where}: imports {module}.load by name (call it qualified)")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name == "torch.load" and not _is_true(_keyword(node, "weights_only")):
                found.append(f"{where}: torch.load without weights_only=True")
            elif name in ("torch.export.load", "torch.jit.load"):
                if (rel, owner.get(id(node))) != PROGRAM_LOADER:
                    found.append(f"{where}: {name} outside {'.'.join(PROGRAM_LOADER)}")
            elif name in ("np.load", "numpy.load") and _is_true(_keyword(node, "allow_pickle")):
                found.append(f"{where}: {name} with allow_pickle=True")
            elif name in ("yaml.load", "yaml.unsafe_load", "yaml.full_load", "yaml.load_all"):
                found.append(f"{where}: {name} (use yaml.safe_load)")
            elif name.endswith("load_program") and rel != PROGRAM_LOADER[0]:
                found.append(f"{where}: calls load_program (for trusted model directories only)")
    return found


def violations(root: Path) -> list[str]:
    found: list[str] = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            found += file_violations(path, path.relative_to(root).as_posix())
    return found


def test_no_code_of_the_project_unpickles_a_file() -> None:
    assert sum(1 for _ in (ROOT / "dlrm_vrgd").rglob("*.py")) > 20  # the tree is there
    assert violations(ROOT) == []


def test_the_check_finds_each_kind_of_unpickling(tmp_path: Path) -> None:
    """Each rule fails on a file that breaks it (so the test above can fail)."""
    bad = tmp_path / "dlrm_vrgd" / "bad.py"
    bad.parent.mkdir()
    bad.write_text(
        "import pickle\n"
        "import torch, numpy as np, yaml\n"
        "from torch import load\n"
        "torch.load('a')\n"
        "torch.load('a', weights_only=False)\n"
        "torch.load('a', weights_only=True)\n"  # allowed
        "torch.export.load('m.pt2')\n"
        "np.load('v.npy', allow_pickle=True)\n"
        "np.load('v.npy')\n"  # allowed: numpy refuses pickles by default
        "yaml.load(open('c'))\n"
        "yaml.safe_load(open('c'))\n"  # allowed
        "def f(d):\n"
        "    from dlrm_vrgd.serve.model import load_program\n"
        "    return load_program(d)\n"
    )
    got = [v.split(": ", 1)[1] for v in violations(tmp_path)]
    assert got == [
        "imports pickle",
        "imports torch.load by name (call it qualified)",
        "torch.load without weights_only=True",
        "torch.load without weights_only=True",
        "torch.export.load outside dlrm_vrgd/serve/model.py.load_program",
        "np.load with allow_pickle=True",
        "yaml.load (use yaml.safe_load)",
        "calls load_program (for trusted model directories only)",
    ], got


if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    problems = violations(root)
    print("\n".join(problems) or "no unpickling")
    sys.exit(1 if problems else 0)

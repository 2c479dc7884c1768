"""The import layering (docs/design.md, "Package map"), read from the source with ``ast``: every
``import`` and ``from ... import`` in every ``.py`` under ``dlrm_vrgd/`` and ``service/``,
at module level or inside a function, absolute or relative, and ``importlib.import_module``
with a literal name.

- only ``cli``, ``study`` (and ``train`` itself) import ``dlrm_vrgd.train``; in the service, only
  the code that launches jobs may: ``data``, ``tracking``, ``serve``, ``optim``, ``embedding``,
  ``model`` and ``torch_model`` never do;
- nothing in ``dlrm_vrgd`` imports ``service``;
- ``optim``, ``rundir`` and ``checkpoint`` import only what their rows of :data:`MAY_IMPORT`
  name;
- every import of our own code anywhere in the checkout (tests and benches too) names a module,
  or a name defined in one, that is there: a module moved without its imports inside functions.

``python tests/test_layering.py [ROOT]`` prints the violations of another checkout (e.g. the
main branch) and exits 1 if there are any.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Who may import ``dlrm_vrgd.train`` (a module or a package and everything under it).
TRAIN_IMPORTERS = (
    "dlrm_vrgd.train",
    "dlrm_vrgd.cli",
    "dlrm_vrgd.study",
    # the service's launch code: what builds and starts a job's command
    "service.jobs.kinds",
    "service.jobs.lifecycle",
    "service.jobs.backends",
)
#: Packages that must not import ``dlrm_vrgd.train`` (covered by TRAIN_IMPORTERS; named so
#: that a rule about a package that is gone fails instead of passing vacuously).
BELOW_TRAIN = (
    "dlrm_vrgd.data",
    "dlrm_vrgd.tracking",
    "dlrm_vrgd.serve",
    "dlrm_vrgd.optim",
    "dlrm_vrgd.embedding",
    "dlrm_vrgd.model",
    "dlrm_vrgd.torch_model",
    "dlrm_vrgd.rundir",
    "dlrm_vrgd.checkpoint",
)
#: Everything of dlrm_vrgd that a package below the others may import (itself included).
MAY_IMPORT = {
    "dlrm_vrgd.optim": (
        "dlrm_vrgd.optim",
        "dlrm_vrgd.config",
        "dlrm_vrgd.embedding.capture",
        "dlrm_vrgd.embedding.views",
        "dlrm_vrgd.malloc",
    ),
    "dlrm_vrgd.rundir": ("dlrm_vrgd.rundir",),
    # the row spaces of a lookup (a torch-only leaf) cut a checkpoint's EMA state per table
    "dlrm_vrgd.checkpoint": (
        "dlrm_vrgd.checkpoint",
        "dlrm_vrgd.rundir",
        "dlrm_vrgd.embedding.capture",
    ),
}


ONLY_TRAIN = "(only cli, study and the service's launch code)"


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(root: Path, path: Path) -> Iterator[tuple[int, str]]:
    """(line, imported name) of every import in ``path``; ``from a import b`` gives ``a.b``
    (``b`` may be a submodule), a relative import is resolved against the module's package."""
    module = module_name(root, path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}" if alias.name != "*" else base
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and getattr(node.func, "attr", getattr(node.func, "id", None))
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.lineno, node.args[0].value


def violations(root: Path) -> list[str]:
    """What breaks the layering in the checkout at ``root``, one line each."""
    found = []
    for rule in dict.fromkeys((*BELOW_TRAIN, *MAY_IMPORT)):
        rel = Path(*rule.split("."))
        if not (root / rel).is_dir() and not (root / rel).with_suffix(".py").is_file():
            found.append(f"{rel}: missing (a layering rule names it)")
    for top in ("dlrm_vrgd", "service"):
        for path in sorted((root / top).rglob("*.py")):
            module = module_name(root, path)
            where = path.relative_to(root)
            for line, name in imports(root, path):
                if within(name, "dlrm_vrgd.train") and not any(
                    within(module, allowed) for allowed in TRAIN_IMPORTERS
                ):
                    found.append(f"{where}:{line}: {module} imports {name} {ONLY_TRAIN}")
                if top == "dlrm_vrgd" and within(name, "service"):
                    found.append(f"{where}:{line}: {module} imports {name} (the service)")
                for package, allowed in MAY_IMPORT.items():
                    if (
                        within(module, package)
                        and within(name, "dlrm_vrgd")
                        and not any(within(name, a) for a in allowed)
                    ):
                        found.append(
                            f"{where}:{line}: {module} imports {name} "
                            f"({package} may import only {', '.join(allowed)})"
                        )
    return found


def test_the_layering_holds() -> None:
    assert violations(ROOT) == []


def test_imports_are_all_found(tmp_path: Path) -> None:
    """The reader sees imports in functions, relative ones and import_module's, and the rules
    catch each kind (a checkout made up here, with one fault of each kind)."""
    pkg = tmp_path / "dlrm_vrgd"
    for sub in ("train", "data", "optim", "rundir", "checkpoint", "embedding", "tracking", "serve"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    for leaf in ("model", "torch_model", "config", "cli"):
        (pkg / f"{leaf}.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (tmp_path / "service").mkdir()
    (pkg / "data" / "rows.py").write_text("def f():\n    from ..train import loop\n")
    (pkg / "optim" / "sparse.py").write_text(
        "from dlrm_vrgd.embedding.capture import RowSpace\nfrom dlrm_vrgd import model\n"
    )
    (pkg / "rundir" / "files.py").write_text("import dlrm_vrgd.config\n")
    (pkg / "cli.py").write_text(
        "import importlib\nfrom dlrm_vrgd.train.loop import train\n"
        "def g():\n    importlib.import_module('service.demo')\n"
    )
    assert violations(tmp_path) == [
        "dlrm_vrgd/cli.py:4: dlrm_vrgd.cli imports service.demo (the service)",
        "dlrm_vrgd/data/rows.py:2: dlrm_vrgd.data.rows imports dlrm_vrgd.train.loop "
        "(only cli, study and the service's launch code)",
        "dlrm_vrgd/optim/sparse.py:2: dlrm_vrgd.optim.sparse imports dlrm_vrgd.model "
        "(dlrm_vrgd.optim may import only dlrm_vrgd.optim, dlrm_vrgd.config, "
        "dlrm_vrgd.embedding.capture, dlrm_vrgd.embedding.views, dlrm_vrgd.malloc)",
        "dlrm_vrgd/rundir/files.py:1: dlrm_vrgd.rundir.files imports dlrm_vrgd.config "
        "(dlrm_vrgd.rundir may import only dlrm_vrgd.rundir)",
    ]


def top_level_names(path: Path) -> set[str] | None:
    """What ``from module import name`` may take from ``path`` (its top-level definitions,
    assignments and imports), or None when it cannot be known (a star import, ``__getattr__``)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                if alias.name == "*":
                    return None
                names.add(alias.asname or alias.name.split(".")[0])
        else:
            for sub in ast.walk(node):
                if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                    names.add(sub.id)
    return None if "__getattr__" in names else names


def source_of(root: Path, name: str) -> Path | None:
    """The file of module ``name`` in the checkout at ``root``, if it is one."""
    rel = Path(*name.split("."))
    for candidate in (root / rel / "__init__.py", (root / rel).with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def unresolved(root: Path) -> list[str]:
    """Imports of our own modules, anywhere in the checkout's Python, that name a module or a
    name that is not there (a move that missed an import inside a function)."""
    found = []
    for top in ("dlrm_vrgd", "service", "tests", "bench", "docs"):
        for path in sorted((root / top).rglob("*.py")):
            for line, name in imports(root, path):
                if not name.startswith(("dlrm_vrgd.", "service.")) or source_of(root, name):
                    continue
                parent, _, leaf = name.rpartition(".")
                module = source_of(root, parent)
                names = top_level_names(module) if module is not None else set()
                if names is not None and leaf not in names:
                    found.append(f"{path.relative_to(root)}:{line}: no {name}")
    return found


def test_every_import_of_our_own_code_resolves() -> None:
    assert unresolved(ROOT) == []


def test_an_import_of_a_moved_module_is_caught(tmp_path: Path) -> None:
    (tmp_path / "dlrm_vrgd" / "data").mkdir(parents=True)
    (tmp_path / "dlrm_vrgd" / "data" / "__init__.py").write_text("")
    (tmp_path / "dlrm_vrgd" / "data" / "rows.py").write_text("def parse():\n    pass\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(
        "from dlrm_vrgd.data.rows import parse\n"
        "def test():\n    from dlrm_vrgd.data.criteo_format import fmt\n"
        "    from dlrm_vrgd.data.rows import gone\n"
    )
    assert unresolved(tmp_path) == [
        "tests/test_x.py:3: no dlrm_vrgd.data.criteo_format.fmt",
        "tests/test_x.py:4: no dlrm_vrgd.data.rows.gone",
    ]


if __name__ == "__main__":
    lines = violations(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT)
    print("\n".join(lines) or "the layering holds")
    sys.exit(1 if lines else 0)

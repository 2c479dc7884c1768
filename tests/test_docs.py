"""The documentation site: `mkdocs build --strict` passes (as `make docs` and CI run it), and
fails on a broken link, a broken anchor or a page left out of the nav; the configuration
reference is the config schema's, field for field."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dlrm_vrgd import config

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _generator(name: str):
    spec = importlib.util.spec_from_file_location(name, DOCS / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gen = _generator("gen_config_reference")
api_gen = _generator("gen_api_reference")


def mkdocs_build(project: Path, site: Path) -> subprocess.CompletedProcess[str]:
    """`mkdocs build --strict` of the project at ``project`` into ``site``."""
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=project,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    proc = mkdocs_build(ROOT, tmp_path / "site")
    assert proc.returncode == 0, proc.stderr
    built = tmp_path / "site"
    for name in ("getting-started", "configuration", "service", "benchmarks", "study/index"):
        assert (built / f"{name}.html").is_file(), name
    reference = (built / "configuration.html").read_text()
    assert "global_batch" in reference and "gsnr_placement" in reference
    # a study's raw records (its progress and its ledger) are not published
    assert not list(built.rglob("metrics.jsonl")) and not list(built.rglob("cells.jsonl"))


@pytest.fixture
def project_copy(tmp_path: Path) -> Path:
    """mkdocs.yml and docs/ copied, to be broken on purpose."""
    copy = tmp_path / "project"
    copy.mkdir()
    shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    shutil.copytree(DOCS, copy / "docs", ignore=shutil.ignore_patterns("cells", "metrics.jsonl"))
    return copy


def test_a_broken_link_anchor_or_an_unlisted_page_fails_the_build(project_copy: Path) -> None:
    """Each fault alone, in one build: mkdocs names all three before it aborts."""
    page = project_copy / "docs" / "getting-started.md"
    page.write_text(
        page.read_text() + "\n[gone](no-such-page.md) and [nowhere](vrgd.md#no-such-heading)\n"
    )
    (project_copy / "docs" / "orphan.md").write_text("# Not in the nav\n")
    proc = mkdocs_build(project_copy, project_copy / "site")
    assert proc.returncode != 0
    assert "no-such-page.md" in proc.stderr
    assert "no-such-heading" in proc.stderr
    assert "orphan.md" in proc.stderr


def test_the_configuration_page_is_the_schema_s() -> None:
    """The committed page equals what the generator makes of today's schema (`make
    config-reference` rewrites it), and `--check` says so."""
    page = (DOCS / "configuration.md").read_text()
    assert gen.splice(page, gen.render()) == page, "run `make reference`"
    assert gen.main(["--check"]) == 0


def _leaf_fields(cls: type, prefix: str = "") -> set[str]:
    """Dotted paths of every non-section field, walked here from the pydantic models."""
    out: set[str] = set()
    for name, info in cls.model_fields.items():
        nested = gen.sections_of(info.annotation)
        for sub in nested:
            out |= _leaf_fields(sub, f"{prefix}{name}.")
        if not nested:
            out.add(prefix + name)
    return out


def test_every_field_of_the_schema_is_on_the_page_with_a_description() -> None:
    fields = _leaf_fields(config.TrainConfig)
    assert {
        "run.global_batch",
        "data.path",
        "optim.sparse.gamma",
        "run.mlflow.tracking_uri",
    } <= fields
    page = (DOCS / "configuration.md").read_text()
    rows = {f"{sec.path}.{f.name}": f for sec in gen.sections() for f in sec.fields}
    assert set(rows) == fields
    for path in fields:
        section, name = path.rsplit(".", 1)
        assert f"### `{section}`" in page, section
        assert f"| `{name}` |" in page, path
    assert [p for p, f in rows.items() if not f.description] == [], (
        "add a `#:` comment above the field in dlrm_vrgd/config.py"
    )


@pytest.mark.parametrize(
    ("path", "type_", "default", "constraints"),
    [
        # read off dlrm_vrgd/config.py: Count(1, MAX_BATCH) = 8192, MAX_BATCH = 1 << 24
        ("run.global_batch", "int", "`8192`", "≥ 1, ≤ 2^24"),
        # Real(gt=0.0, le=1.0) = 0.1
        ("optim.dense.gamma", "float", "`0.1`", "> 0, ≤ 1"),
        # Fraction: ge=0, lt=1
        ("optim.sparse.ema_beta", "float", "`0.9`", "≥ 0, < 1"),
        # Literal["update", "gradient"] = "update"
        ("optim.sparse.gsnr_placement", "`update` \\| `gradient`", "`update`", ""),
        # Count(1, 4096) | None = None
        ("run.threads", "int or null", "`null`", "≥ 1, ≤ 4,096"),
        # a tuple of two Fractions
        ("optim.dense.betas", "[float, float]", "`[0.9, 0.999]`", "2 items, each ≥ 0, < 1"),
        # Annotated[Path, maxLength 4095], no default
        ("data.path", "path", "required", "at most 4,095 characters"),
        # a Flag
        ("run.tensorboard", "bool", "`true`", ""),
        # Seed = Count(0, MAX_SEED), MAX_SEED = 2^63 - 1
        ("run.seed", "int", "`0`", "≥ 0, ≤ 2^63 − 1"),
    ],
)
def test_a_field_s_row_reads_as_its_declaration(
    path: str, type_: str, default: str, constraints: str
) -> None:
    rows = {f"{sec.path}.{f.name}": f for sec in gen.sections() for f in sec.fields}
    row = rows[path]
    assert (row.type, row.default, row.constraints) == (type_, default, constraints)


# ------------------------------------------------------------------------------ the HTTP API
@pytest.fixture(scope="module")
def api_page() -> str:
    return (DOCS / "api.md").read_text()


def test_the_api_page_is_the_openapi_schema_s(api_page: str) -> None:
    assert api_gen.splice(api_page, api_gen.render()) == api_page, "run `make reference`"


def test_every_route_of_the_service_is_on_the_api_page(api_page: str) -> None:
    """Walked here from each route module's router (service/api/routes/), not from the schema
    the generator reads."""
    import importlib
    import pkgutil

    from fastapi import APIRouter
    from fastapi.routing import APIRoute

    import service.api.routes as package
    from service.main import API_PREFIX

    routes = []
    for info in pkgutil.iter_modules(package.__path__):
        router = getattr(importlib.import_module(f"{package.__name__}.{info.name}"), "router", None)
        if isinstance(router, APIRouter):
            routes += [
                (method, API_PREFIX + re.sub(r"\{(\w+):\w+\}", r"{\1}", route.path))
                for route in router.routes
                if isinstance(route, APIRoute) and route.include_in_schema
                for method in route.methods
            ]
    assert ("POST", "/api/v1/jobs") in routes and len(routes) >= 15
    for method, path in routes:  # a converter ({path:path}) is not part of the documented path
        assert f"### `{method} {path}`" in api_page, (method, path)
    api_gen.openapi()  # the schema is built without starting anything
    health = api_page.split("### `GET /api/v1/health`", 1)[1].split("###", 1)[0]
    assert "No token needed." in health
    jobs = api_page.split("### `GET /api/v1/jobs`", 1)[1].split("###", 1)[0]
    assert "No token needed." not in jobs and "`401`" in jobs
    # service/api/routes/jobs.py: limit: Annotated[int, Query(ge=1, le=1000)] = 100
    assert "| `limit` | query | int | `100` | ≥ 1, ≤ 1,000 |" in jobs

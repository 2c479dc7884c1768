"""dlrm-vrgd control service: a FastAPI job API over the trainer (DESIGN.md 5)."""

from __future__ import annotations

from importlib import metadata

try:
    __version__ = metadata.version("dlrm-vrgd")
except metadata.PackageNotFoundError:  # pragma: no cover - source tree without install
    __version__ = "0.0.0"

"""``GET /health``: the one route without auth."""

from __future__ import annotations

from fastapi import APIRouter

from service import __version__
from service.schemas import HealthPublic

router = APIRouter(tags=["health"])


@router.get("/health", response_model=HealthPublic)
def health() -> HealthPublic:
    """The service is up and answering."""
    return HealthPublic(status="ok", version=__version__)

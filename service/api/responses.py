"""Documented error answers (OpenAPI ``responses``) shared by the routers."""

from __future__ import annotations

from typing import Any

from service.schemas import Message, ValidationMessage

UNAUTHORIZED: dict[int | str, dict[str, Any]] = {
    401: {"model": Message, "description": "Missing or invalid bearer token"}
}
NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"model": Message, "description": "Not found"}}
CONFLICT: dict[int | str, dict[str, Any]] = {
    409: {"model": Message, "description": "Not allowed in the job's current state"}
}
DAMAGED: dict[int | str, dict[str, Any]] = {
    409: {"model": Message, "description": "The model on disk does not match its manifest"}
}
INVALID: dict[int | str, dict[str, Any]] = {
    422: {"model": ValidationMessage, "description": "Invalid input; `field` names it"}
}
UNAVAILABLE: dict[int | str, dict[str, Any]] = {
    503: {"model": Message, "description": "The backend cannot take jobs now; `detail` says why"}
}

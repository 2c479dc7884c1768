"""Dependencies of the routes, as ``Annotated`` aliases."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Path, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from service.jobs.service import JobService
from service.security import Token
from service.settings import Settings

bearer_scheme = HTTPBearer(
    auto_error=False,
    scheme_name="bearer",
    description="The service token: DLRM_VRGD_TOKEN, or the one printed at start "
    "(saved in DATA_DIR/token).",
)


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_service(request: Request) -> JobService:
    return request.app.state.service


def require_token(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)],
) -> None:
    """401 unless the request carries ``Authorization: Bearer <token>``."""
    token: Token = request.app.state.token
    if credentials is None or not token.matches(credentials.credentials):
        raise HTTPException(
            status_code=status.HTTP_401_UNAUTHORIZED,
            detail="missing or invalid bearer token",
            headers={"WWW-Authenticate": "Bearer"},
        )


SettingsDep = Annotated[Settings, Depends(get_settings)]
ServiceDep = Annotated[JobService, Depends(get_service)]
JobId = Annotated[str, Path(description="Job id, as returned by POST /jobs")]

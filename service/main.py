"""The app factory and the server entry point.

``create_app(settings)`` builds the FastAPI app; its lifespan takes the data directory's lock
(one service per data directory), opens the store, resolves the token and starts the runner.
``serve(settings)`` runs it under uvicorn (``dlrm-vrgd serve``).
"""

from __future__ import annotations

import asyncio
import codecs
import fcntl
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, RedirectResponse, Response
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dlrm_vrgd.redact import redact
from service import __version__
from service.api.deps import require_token
from service.api.responses import UNAUTHORIZED
from service.api.routes import artifacts, events, health, jobs, metrics, pages
from service.errors import InvalidInput, ServiceError, StorageError
from service.jobs.backends import BackendUnavailable, make_backend
from service.jobs.notifier import Notifier
from service.jobs.runner import Runner
from service.jobs.service import JobService
from service.jobs.store import Store
from service.security import StartupRefused, check_bind, resolve_token
from service.settings import Settings
from service.shown import shown

logger = logging.getLogger(__name__)

API_PREFIX = "/api/v1"
STATIC_DIR = Path(__file__).resolve().parent / "static"
#: Config sections whose name pydantic puts in error locations (discriminated union tags).
_UNION_TAGS = ("synthetic", "criteo")
_KIND_TAGS = ("train", "study", "score")


# ------------------------------------------------------------------------------- lock
class DataDirLock:
    """An exclusive ``flock`` on ``DATA_DIR/service.lock``: one service per data directory.
    Released when the holder exits, however it exits (the kernel drops the lock)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise StartupRefused(
                f"another service (pid {holder}) is using {self.path.parent}; stop it or "
                "choose another data directory (DLRM_VRGD_DATA_DIR / --data-dir)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def preflight(settings: Settings) -> None:
    """Fail early, with a message for people, where the lifespan would fail."""
    check_bind(settings)
    lock = DataDirLock(settings.lock_path)
    lock.acquire()
    lock.release()
    try:
        make_backend(settings).check()
    except BackendUnavailable as err:
        raise StartupRefused(str(err)) from None


# ------------------------------------------------------------------------- body limit
class BodyLimits:
    """What every request body must be before a route sees it, else an answer naming
    ``body``: at most ``max_bytes`` (by Content-Length up front, or while streaming a body
    without one; 422), UTF-8 without a NUL byte (a JSON text is: this refuses UTF-16 and
    UTF-32, which Python's ``json`` would otherwise guess; 422), and whole within
    ``timeout_s`` of the first read (408, and the connection is closed: a client that sends
    less than its Content-Length cannot hold it; uvicorn bounds only the idle time between
    requests)."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    @staticmethod
    def _issue(message: str, kind: str, status: int = 422) -> HTTPException:
        issue = {"loc": ["body"], "field": "body", "msg": message, "type": kind}
        headers = {"Connection": "close"} if status == 408 else None
        return HTTPException(status_code=status, detail=[issue], headers=headers)

    def _too_large(self) -> HTTPException:
        return self._issue(f"request body larger than {self.max_bytes} bytes", "body_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for key, value in scope.get("headers", []):
            if key == b"content-length":
                if not value.strip().isdigit() or int(value) > self.max_bytes:
                    err = self._too_large()
                    await JSONResponse({"detail": err.detail}, 422)(scope, receive, send)
                    return
        received = 0
        started = False
        body_done = False
        deadline: float | None = None
        decoder = codecs.getincrementaldecoder("utf-8")()
        loop = asyncio.get_running_loop()

        async def checked_receive() -> Message:
            nonlocal received, body_done, deadline
            if body_done:  # after the body: the disconnect a streaming answer waits for
                return await receive()
            if deadline is None:
                deadline = loop.time() + self.timeout_s
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise self._issue(
                    f"request body not received whole within {self.timeout_s:g} s "
                    "(shorter than its Content-Length?)",
                    "body_timeout",
                    408,
                ) from None
            if message["type"] != "http.request":
                return message
            chunk = message.get("body", b"")
            received += len(chunk)
            if received > self.max_bytes:
                raise self._too_large()
            more = message.get("more_body", False)
            try:
                decoder.decode(chunk, final=not more)
            except UnicodeDecodeError as err:
                raise self._issue(
                    f"request body is not UTF-8 JSON (byte {received - len(chunk) + err.start})",
                    "json_invalid",
                ) from None
            if b"\x00" in chunk:
                raise self._issue(
                    "request body holds a NUL byte (not UTF-8 JSON: UTF-16 or UTF-32?)",
                    "json_invalid",
                )
            body_done = not more
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, checked_receive, tracking_send)
        except HTTPException as err:
            if started or err.status_code not in (408, 422):
                raise
            await JSONResponse({"detail": err.detail}, err.status_code, err.headers)(
                scope, receive, send
            )


class RedactFilter(logging.Filter):
    """Masks secrets (``?token=...``, ``user:password@``) in a log record's message and
    arguments: uvicorn's access log writes each request's query string."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
        return True


def redact_server_logs() -> None:
    """Install :class:`RedactFilter` on uvicorn's loggers (after uvicorn configured them)."""
    for name in ("uvicorn.access", "uvicorn.error"):
        log = logging.getLogger(name)
        if not any(isinstance(f, RedactFilter) for f in log.filters):
            log.addFilter(RedactFilter())


# ---------------------------------------------------------------------------- errors
def _field(loc: tuple[Any, ...] | list[Any]) -> str:
    parts = list(loc)
    if parts and parts[0] in ("body", "query", "path", "header"):
        source, parts = parts[0], parts[1:]
        if source == "body" and parts and parts[0] in _KIND_TAGS:
            parts = parts[1:]  # the job-kind tag of the request body's union
        if source == "body" and (not parts or isinstance(parts[0], int)):
            return "body"
        if source != "body":  # a repeated query parameter: name it, not its position
            parts = [p for p in parts if not isinstance(p, int)]
    cleaned = [
        str(p)
        for i, p in enumerate(parts)
        if not (p in _UNION_TAGS and i > 0 and parts[i - 1] == "data")
        and not (isinstance(p, str) and any(c in p for c in "-[("))  # union member tags
    ]
    return ".".join(cleaned) or "body"


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    detail = []
    for err in exc.errors():
        loc = list(err.get("loc", ()))
        etype = str(err.get("type", "value_error"))
        detail.append(
            {
                "loc": loc,
                "field": "body" if etype == "json_invalid" else _field(loc),
                "msg": shown(str(err.get("msg", "invalid")), request.app.state.settings),
                "type": etype,
            }
        )
    return JSONResponse({"detail": detail}, status_code=422)


async def _service_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ServiceError)
    settings: Settings = request.app.state.settings
    if isinstance(exc, InvalidInput):
        msg = shown(exc.detail, settings)
        issues = [{"loc": list(exc.loc), "field": exc.field, "msg": msg, "type": "invalid"}]
        for field in exc.also:
            loc = [*exc.loc[: len(exc.loc) - len(exc.field.split("."))], *field.split(".")]
            issues.append({"loc": loc, "field": field, "msg": msg, "type": "invalid"})
        return JSONResponse({"detail": issues}, status_code=422)
    return JSONResponse({"detail": shown(exc.message, settings)}, status_code=exc.status_code)


async def _http_error(request: Request, exc: Exception) -> Response:
    """FastAPI answers a body it cannot decode (nesting too deep, a number too long, bytes
    that are not UTF-8) with 400; like every other bad body, that is a 422 naming ``body``."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 400 and exc.detail == "There was an error parsing the body":
        cause = exc.__cause__
        why = f": {type(cause).__name__}: {str(cause)[:200]}" if cause is not None else ""
        issue = {
            "loc": ["body"],
            "field": "body",
            "msg": f"request body is not valid JSON{why}",
            "type": "json_invalid",
        }
        return JSONResponse({"detail": [issue]}, status_code=422)
    return await http_exception_handler(request, exc)


async def _os_error(request: Request, exc: Exception) -> JSONResponse:
    """A filesystem error no route expected: a clear answer, not a 500."""
    assert isinstance(exc, OSError)
    logger.error("%s %s: %s", request.method, request.url.path, redact(str(exc)))
    err = StorageError.from_os_error("the request's data", exc)
    return JSONResponse({"detail": err.message}, status_code=err.status_code)


# ------------------------------------------------------------------------------- app
def create_app(settings: Settings | None = None) -> FastAPI:
    """The service app for ``settings`` (default: from the environment)."""
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        check_bind(settings)
        lock = DataDirLock(settings.lock_path)
        lock.acquire()
        store: Store | None = None
        runner: Runner | None = None
        try:
            settings.jobs_dir.mkdir(parents=True, exist_ok=True)
            settings.mlflow_root.mkdir(parents=True, exist_ok=True)
            app.state.token = resolve_token(settings)
            store = Store(settings.db_path)
            notifier = Notifier()
            runner = Runner(settings, store, notifier)
            service = JobService(settings, store, runner, notifier)
            service.should_exit = app.state.should_exit
            app.state.service = service
            await runner.start()
            logger.info("service ready: data in %s", settings.data_dir)
            yield
        finally:
            if runner is not None:
                await runner.stop()
            if store is not None:
                store.close()
            lock.release()

    app = FastAPI(
        title="dlrm-vrgd control service",
        version=__version__,
        summary="Submit DLRM training jobs, watch AUC and per-layer GSNR live, fetch results.",
        lifespan=lifespan,
        # FastAPI's pages load Swagger UI / ReDoc from a CDN: /docs is served from the
        # package instead (service/api/routes/pages.py), under the dashboard's strict policy
        docs_url=None,
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.should_exit = lambda: False
    app.add_middleware(
        BodyLimits, max_bytes=settings.max_body_bytes, timeout_s=settings.body_timeout_s
    )
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(ServiceError, _service_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(OSError, _os_error)

    api = APIRouter(prefix=API_PREFIX)
    api.include_router(health.router)
    protected = APIRouter(dependencies=[Depends(require_token)], responses={**UNAUTHORIZED})
    for module in (jobs, metrics, events, artifacts):
        protected.include_router(module.router)
    api.include_router(protected)
    app.include_router(api)
    pages.install(app)  # the dashboard: /ui/ pages, /ui/static assets

    @app.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse(f"{pages.UI_PREFIX}/")

    return app


def serve(settings: Settings) -> None:
    """Run the service under uvicorn until interrupted."""
    import uvicorn

    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=3,
        lifespan="on",
    )
    redact_server_logs()
    server = uvicorn.Server(config)
    app.state.should_exit = lambda: server.should_exit
    server.run()

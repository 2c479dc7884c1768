"""Where a job's MLflow export may write, and which tracking servers get the service's
credentials.

The trainer takes any MLflow URI; a job submitted to the service writes with the service's
rights and, through MLflow, sends the service's credentials, so ``run.mlflow`` is held to:

* ``tracking_uri``: an ``http(s)://`` tracking server, or a local store (``sqlite:////ABS/PATH.db``,
  ``file:///ABS/DIR`` or a plain absolute directory) under the service's MLflow directory
  (``DLRM_VRGD_MLFLOW_DIR``, default ``DATA_DIR/mlflow``), and never one of the service's own
  files (its database, token, lock) or a job directory;
* ``artifact_location``: read as MLflow reads it (:func:`mlflow_scheme`: a one-letter scheme
  such as ``c:/...`` is a local path, as MLflow takes it), a local location under the MLflow
  directory, or one of the operator's roots (``DLRM_VRGD_MLFLOW_ARTIFACT_ROOTS``) or below it;
  anything else is refused;
* the service's MLflow credentials (``MLFLOW_TRACKING_USERNAME`` / ``_PASSWORD`` /
  ``_TOKEN`` and MLflow's other authentication variables, :data:`TRACKING_AUTH_ENV`) reach a
  job only when its tracking server is one of the operator's
  (``DLRM_VRGD_MLFLOW_CREDENTIAL_SERVERS``, :func:`sends_credentials`); any other job runs
  without them, and a note on the job says so.

Credentials in a URI are refused by the config itself (:func:`dlrm_vrgd.config.check_uri`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from dlrm_vrgd.config import MlflowConfig
from dlrm_vrgd.redact import CREDENTIAL_ENV
from service.errors import InvalidInput
from service.settings import Settings

REMOTE_TRACKING = ("http", "https")
#: What MLflow authenticates a tracking server's requests with: left out of the environment of
#: a job whose server is not one of DLRM_VRGD_MLFLOW_CREDENTIAL_SERVERS.
TRACKING_AUTH_ENV = (
    *CREDENTIAL_ENV,
    "MLFLOW_TRACKING_CLIENT_CERT_PATH",
    "MLFLOW_TRACKING_AWS_SIGV4",
    "MLFLOW_TRACKING_AUTH",
)
_DEFAULT_PORTS = {"http": 80, "https": 443}
#: A host as every HTTP client reads it the same way: a DNS name or IPv4 address, or an IPv6
#: address in brackets; an optional port. Anything else (``%``, ``\\``, ``@``, spaces) never
#: matches an allowed server.
_NETLOC = re.compile(
    r"^(?:[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252})|\[[0-9A-Fa-f:.]{2,45}\])(?::\d{1,5})?$"
)
_BAD_LOCATION = re.compile(r"[\x00-\x20\x7f\\%]")

Origin = tuple[str, str, int]


# ------------------------------------------------------------------------- credentials
def origin(uri: str) -> Origin | None:
    """``(scheme, host, port)`` of an ``http(s)://`` URI written plainly (no user info, no
    escapes), else None."""
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme not in REMOTE_TRACKING or not _NETLOC.match(parts.netloc):
        return None
    try:
        port = parts.port
    except ValueError:
        return None
    host = (parts.hostname or "").lower()
    if not host:
        return None
    return scheme, host, port if port is not None else _DEFAULT_PORTS[scheme]


def parse_origins(text: str) -> frozenset[Origin]:
    """``DLRM_VRGD_MLFLOW_CREDENTIAL_SERVERS``: comma-separated ``http(s)://HOST[:PORT]``
    (ValueError naming the entry otherwise)."""
    out = set()
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        parts = urlsplit(item)
        found = origin(item)
        if found is None or parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ValueError(
                f"{item!r} is not an origin http(s)://HOST[:PORT] (no path, user or query)"
            )
        out.add(found)
    return frozenset(out)


def job_tracking_uri(kind: str, config: dict[str, Any]) -> str | None:
    """The tracking URI a stored job's config exports to (a study: its base's), or None."""
    section = config.get("base") if kind == "study" else config
    run = section.get("run") if isinstance(section, dict) else None
    mlflow = run.get("mlflow") if isinstance(run, dict) else None
    uri = mlflow.get("tracking_uri") if isinstance(mlflow, dict) else None
    return uri if isinstance(uri, str) else None


def sends_credentials(uri: str | None, settings: Settings) -> bool:
    """Whether a job exporting to ``uri`` may hold the service's MLflow credentials: only for
    a tracking server among ``DLRM_VRGD_MLFLOW_CREDENTIAL_SERVERS``."""
    if uri is None:
        return False
    found = origin(uri)
    return found is not None and found in parse_origins(settings.mlflow_credential_servers)


def withheld_note(kind: str, config: dict[str, Any], settings: Settings) -> str | None:
    """What a job is told when it exports to an http(s) server that does not get the
    service's credentials although the service holds some; None otherwise."""
    uri = job_tracking_uri(kind, config)
    held = [name for name in TRACKING_AUTH_ENV if os.environ.get(name)]
    if uri is None or not held or sends_credentials(uri, settings):
        return None
    if urlsplit(uri).scheme.lower() not in REMOTE_TRACKING:
        return None
    return (
        "MLflow credentials withheld: the tracking server of run.mlflow.tracking_uri is not "
        "one of DLRM_VRGD_MLFLOW_CREDENTIAL_SERVERS, so the job runs without "
        f"{', '.join(held)} (a server that needs them refuses the export; training goes on)"
    )


def job_environment(
    env: dict[str, str], kind: str, config: dict[str, Any], settings: Settings
) -> dict[str, str]:
    """``env`` without MLflow's authentication variables unless the job's tracking server
    is allowed them (:func:`sends_credentials`)."""
    if sends_credentials(job_tracking_uri(kind, config), settings):
        return env
    return {k: v for k, v in env.items() if k not in TRACKING_AUTH_ENV}


# --------------------------------------------------------------------------- locations
def mlflow_scheme(location: str) -> str:
    """The scheme MLflow picks an artifact store by (``mlflow.utils.uri.get_uri_scheme``):
    ``urlparse``'s, except that a one-letter scheme (a Windows drive, ``c:/...``) is a local
    path: ``""``. Tested against MLflow's own where it is installed."""
    scheme = urlsplit(location).scheme
    if len(scheme) == 1 and scheme.isalpha():
        return ""
    return scheme.lower()


def parse_roots(text: str) -> list[tuple[str, str, list[str]]]:
    """``DLRM_VRGD_MLFLOW_ARTIFACT_ROOTS``: comma-separated URI roots as ``(scheme, netloc,
    path segments)`` (ValueError naming the entry otherwise)."""
    out = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        try:
            out.append(_location_parts(item))
        except ValueError as err:
            raise ValueError(f"artifact root {item!r}: {err}") from None
        if out[-1][0] in ("", "file"):
            raise ValueError(
                f"artifact root {item!r}: local locations are set by DLRM_VRGD_MLFLOW_DIR"
            )
    return out


def _location_parts(location: str) -> tuple[str, str, list[str]]:
    if _BAD_LOCATION.search(location):
        raise ValueError("a space, control character, backslash or '%' in it")
    parts = urlsplit(location)
    if parts.query or parts.fragment or "@" in parts.netloc:
        raise ValueError("a query, fragment or user info in it")
    scheme = mlflow_scheme(location)
    if not scheme:
        raise ValueError("a local path, not a URI")
    segments = [s for s in parts.path.split("/") if s]
    if any(s in (".", "..") for s in segments) or "//" in parts.path.rstrip("/")[1:]:
        raise ValueError("an empty, '.' or '..' path segment")
    return scheme, parts.netloc.lower(), segments


def _check_location(location: str, settings: Settings) -> None:
    """``artifact_location`` read as MLflow will use it: local (under the MLflow directory) or
    at or below one of the operator's roots."""
    scheme = mlflow_scheme(location)
    if scheme == "":  # a plain path, or c:/... which MLflow takes for a local path here
        _check_under(settings, location)
        return
    if scheme == "file":
        local = _local_path(location, sqlite=False)
        assert local is not None
        _check_under(settings, local)
        return
    roots = parse_roots(settings.mlflow_artifact_roots)
    kind, netloc, segments = _location_parts(location)
    for r_kind, r_netloc, r_segments in roots:
        if (kind, netloc) == (r_kind, r_netloc) and segments[: len(r_segments)] == r_segments:
            return
    allowed = settings.mlflow_artifact_roots.strip() or "none set"
    raise ValueError(
        f"scheme {scheme!r}: the service takes an artifact location under its MLflow directory "
        f"or under DLRM_VRGD_MLFLOW_ARTIFACT_ROOTS ({allowed})"
    )


def _local_path(uri: str, sqlite: bool) -> str | None:
    """The local path a store URI names (None: not a local store this module knows)."""
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if sqlite:
        if scheme != "sqlite":
            return None
        # SQLAlchemy: sqlite:///rel.db is relative, sqlite:////abs.db absolute
        if not uri[len("sqlite:") :].startswith("///"):
            raise ValueError("write sqlite:////ABSOLUTE/PATH.db (four slashes: an absolute path)")
        return uri[len("sqlite:///") :]
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"a file URI on another host ({parts.netloc!r})")
        return unquote(parts.path)
    if scheme == "":  # a plain path: MLflow's file store
        return uri
    return None


def _check_under(settings: Settings, text: str) -> None:
    if "\x00" in text or "%" in text:
        raise ValueError("a path with a NUL or '%' character")
    if not text.startswith("/"):
        raise ValueError(
            "an absolute path is needed, under the service's MLflow directory (MLflow reads "
            "this as a local path relative to the job's working directory)"
        )
    root = settings.mlflow_root.resolve()
    try:
        path = Path(os.path.normpath(text)).resolve()
    except (OSError, RuntimeError) as err:
        raise ValueError(f"cannot be resolved ({type(err).__name__})") from None
    db = settings.db_path
    own = [db, settings.token_path, settings.lock_path]
    own += [db.with_name(db.name + suffix) for suffix in ("-wal", "-shm", "-journal")]
    if any(path == p.resolve() for p in own) or path.is_relative_to(settings.jobs_dir.resolve()):
        raise ValueError(
            "names one of the service's own files (its database, token, lock or a job's "
            "directory); use a path under the MLflow directory"
        )
    if not path.is_relative_to(root):
        raise ValueError(
            "outside the service's MLflow directory (DLRM_VRGD_MLFLOW_DIR): name a file or "
            "directory inside it"
        )


def check_mlflow(cfg: MlflowConfig | None, settings: Settings, field: str) -> None:
    """:class:`InvalidInput` naming ``FIELD.tracking_uri`` / ``FIELD.artifact_location`` where
    ``cfg`` would write outside the service's MLflow directory or the operator's roots."""
    if cfg is None:
        return
    uri = cfg.tracking_uri
    try:
        scheme = urlsplit(uri).scheme.lower()
        if scheme not in REMOTE_TRACKING:
            local = _local_path(uri, sqlite=True)
            if local is None:
                local = _local_path(uri, sqlite=False)
            if local is None:
                raise ValueError(
                    f"scheme {scheme!r}: the service takes http(s)://HOST, or sqlite:////PATH.db "
                    "or file:///DIR under its MLflow directory"
                )
            _check_under(settings, local)
    except ValueError as err:
        _refuse(f"{field}.tracking_uri", str(err))
    if cfg.artifact_location is not None:
        try:
            _check_location(cfg.artifact_location, settings)
        except ValueError as err:
            _refuse(f"{field}.artifact_location", str(err))


def _refuse(field: str, message: str) -> None:
    raise InvalidInput(field, message, ("body", *field.split(".")))

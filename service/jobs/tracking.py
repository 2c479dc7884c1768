"""Where a job's MLflow export may write, on the service.

The trainer takes any MLflow URI; a job submitted to the service writes with the service's
rights, so ``run.mlflow`` is held to: an ``http(s)://`` tracking server, or a local store
(``sqlite:////ABS/PATH.db``, ``file:///ABS/DIR`` or a plain absolute directory) under the
service's MLflow directory (``DLRM_VRGD_MLFLOW_DIR``, default ``DATA_DIR/mlflow``), and never
one of the service's own files (its database, token, lock) or a job directory. A local
``artifact_location`` is held to the same directory; a remote one (``s3://``...) is the
tracking server's business. Credentials are refused by the config itself
(:func:`dlrm_vrgd.config.check_uri`): they come from the environment.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote, urlsplit

from dlrm_vrgd.config import MlflowConfig
from service.errors import InvalidInput
from service.settings import Settings

REMOTE_TRACKING = ("http", "https")


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
        raise ValueError("an absolute path is needed, under the service's MLflow directory")
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
    ``cfg`` would write outside the service's MLflow directory."""
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
            local = _local_path(cfg.artifact_location, sqlite=False)
            if local is not None:
                _check_under(settings, local)
        except ValueError as err:
            _refuse(f"{field}.artifact_location", str(err))


def _refuse(field: str, message: str) -> None:
    raise InvalidInput(field, message, ("body", *field.split(".")))

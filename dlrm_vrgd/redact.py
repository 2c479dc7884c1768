"""The one redaction of secrets in text: the values of the secrets this process holds in its
environment, credentials of a URI and secret query parameters.

Everything that echoes a URI, a request line or a message from a server (the run's files, logs,
the service's answers, its event stream and access log) passes it through :func:`redact`; a
config whose URI :func:`redact` would change is refused (:mod:`dlrm_vrgd.config`), so what is
stored is never altered by it. Credentials of a tracking server come from the environment
instead (:data:`CREDENTIAL_ENV`, MLflow's own convention), and their values are masked wherever
they appear, whoever echoes them (a tracking server's error that repeats the password, a
``Basic`` header it prints back): every environment variable named like a secret
(:data:`SECRET_NAME`: ``*_PASSWORD``, ``*_TOKEN``, ``*_SECRET``, ``*_API_KEY``, ...) with a
value of at least :data:`MIN_SECRET_CHARS` characters, as written, URL-encoded and JSON-escaped,
and ``base64(user:password)`` of MLflow's pair (an HTTP ``Basic`` credential).
"""

from __future__ import annotations

import base64
import functools
import json
import os
import re
from typing import Any
from urllib.parse import quote

#: What replaces a secret.
MASK = "***"
#: Environment variables MLflow reads its tracking server's credentials from.
CREDENTIAL_ENV = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
#: Environment variables whose values are secrets (masked wherever they appear): a name that
#: ends in PASSWORD, PASSWD, TOKEN, SECRET, SECRET_KEY, API_KEY/APIKEY, ACCESS_KEY,
#: PRIVATE_KEY or CONNECTION_STRING (``MLFLOW_TRACKING_PASSWORD``, ``AWS_SECRET_ACCESS_KEY``,
#: ``AWS_SESSION_TOKEN``, ``DLRM_VRGD_TOKEN``...); settings that merely mention one
#: (``DLRM_VRGD_MLFLOW_CREDENTIAL_SERVERS``) are not secrets.
SECRET_NAME = re.compile(
    r"(?:^|_)(?:PASSWORD|PASSWD|TOKEN|SECRET|SECRET_KEY|API_?KEY|ACCESS_KEY|PRIVATE_KEY"
    r"|CONNECTION_STRING)$",
    re.IGNORECASE,
)
#: Shorter values are not masked: they would mask ordinary words (``true``, ``1``).
MIN_SECRET_CHARS = 6

_STOP = r"\s\"'<>`"
#: ``scheme://userinfo@``: userinfo is everything up to the authority's last ``@``.
_USERINFO = re.compile(rf"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://)[^/{_STOP}]*@")
#: ``?name=value`` / ``&name=value`` / ``;name=value`` where the name says it is a secret.
_SECRET_PARAM = re.compile(
    rf"(?P<head>[?&;][^=&;#{_STOP}]*"
    r"(?:token|secret|passw|pwd|key|auth|credential|signature|sig|session)"
    rf"[^=&;#{_STOP}]*=)[^&;#{_STOP}]*",
    re.IGNORECASE,
)


def _forms(value: str) -> set[str]:
    """How a secret may be written back: as it is, URL-encoded, JSON-escaped."""
    return {value, quote(value, safe=""), json.dumps(value)[1:-1]}


def secret_values(environ: dict[str, str]) -> list[str]:
    """The secret values of ``environ`` (and the forms they are echoed in), longest first."""
    values: set[str] = set()
    for name, value in environ.items():
        if SECRET_NAME.search(name) and len(value) >= MIN_SECRET_CHARS:
            values |= _forms(value)
    user, password = environ.get(CREDENTIAL_ENV[0]), environ.get(CREDENTIAL_ENV[1])
    if user and password:  # the HTTP Basic credential MLflow sends
        pair = f"{user}:{password}"
        values |= _forms(pair) | {base64.b64encode(pair.encode()).decode()}
    return sorted((v for v in values if len(v) >= MIN_SECRET_CHARS), key=lambda v: (-len(v), v))


@functools.lru_cache(maxsize=4)
def _secrets_pattern(snapshot: tuple[tuple[Any, Any], ...]) -> re.Pattern[str] | None:
    values = secret_values({os.fsdecode(k): os.fsdecode(v) for k, v in snapshot})
    return re.compile("|".join(map(re.escape, values))) if values else None


def _environment() -> tuple[tuple[Any, Any], ...]:
    """This process's environment as it stands (its raw table: no decoding per call)."""
    data = getattr(os.environ, "_data", None)
    return tuple(data.items()) if isinstance(data, dict) else tuple(os.environ.items())


def redact(text: str) -> str:
    """``text`` with every secret value of this process's environment, every URI's
    ``user:password@`` and every secret query value masked."""
    pattern = _secrets_pattern(_environment())
    if pattern is not None:
        text = pattern.sub(MASK, text)
    text = _USERINFO.sub(rf"\g<head>{MASK}@", text)
    return _SECRET_PARAM.sub(rf"\g<head>{MASK}", text)


def redact_obj(obj: Any) -> Any:
    """:func:`redact` applied to every string of a JSON-like value (keys and values)."""
    if isinstance(obj, str):
        return redact(obj)
    if isinstance(obj, dict):
        return {redact_obj(k): redact_obj(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [redact_obj(v) for v in obj]
    return obj

"""The one redaction of secrets in text: credentials of a URI and secret query parameters.

Everything that echoes a URI or a request line (the run's files, logs, the service's answers,
its event stream and access log) passes it through :func:`redact`; a config whose URI
:func:`redact` would change is refused (:mod:`dlrm_vrgd.config`), so what is stored is never
altered by it. Credentials of a tracking server come from the environment instead
(:data:`CREDENTIAL_ENV`, MLflow's own convention).
"""

from __future__ import annotations

import re
from typing import Any

#: What replaces a secret.
MASK = "***"
#: Environment variables MLflow reads its tracking server's credentials from.
CREDENTIAL_ENV = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")

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


def redact(text: str) -> str:
    """``text`` with every URI's ``user:password@`` and every secret query value masked."""
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

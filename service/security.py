"""Bearer-token handling: where the token comes from, and the rule for public binds.

The token is taken from ``DLRM_VRGD_TOKEN``; without it, from ``DATA_DIR/token`` (a token this
service generated earlier), else a new one is generated and saved there with mode 0600 so that
clients keep working across restarts. Listening beyond the loopback interface needs a token set
explicitly in the environment, at least :data:`MIN_PUBLIC_TOKEN_CHARS` long.
"""

from __future__ import annotations

import hmac
import os
import secrets
from dataclasses import dataclass
from typing import Literal

from service.settings import MIN_PUBLIC_TOKEN_CHARS, Settings

TokenSource = Literal["environment", "file", "generated"]


class StartupRefused(RuntimeError):
    """The service must not start with these settings; the message says why and what to do."""


@dataclass(frozen=True)
class Token:
    value: str
    source: TokenSource

    def matches(self, presented: str) -> bool:
        """Constant-time comparison."""
        return hmac.compare_digest(presented.encode(), self.value.encode())


def check_bind(settings: Settings) -> None:
    """Refuse a non-loopback bind without an explicit, long enough token."""
    if settings.is_loopback:
        return
    token = settings.token.get_secret_value() if settings.token is not None else ""
    if len(token.strip()) < MIN_PUBLIC_TOKEN_CHARS:  # spaces are not a secret
        raise StartupRefused(
            f"refusing to listen on {settings.host}: a non-loopback address needs "
            f"DLRM_VRGD_TOKEN set to a secret of at least {MIN_PUBLIC_TOKEN_CHARS} characters "
            "other than whitespace (or listen on 127.0.0.1)"
        )


def resolve_token(settings: Settings) -> Token:
    """The token from the environment, the data directory, or a new one (saved, mode 0600)."""
    if settings.token is not None:
        value = settings.token.get_secret_value()
        if not value.strip():
            raise StartupRefused("DLRM_VRGD_TOKEN is set but empty (or only whitespace)")
        return Token(value, "environment")
    path = settings.token_path
    try:
        value = path.read_text().strip()
    except FileNotFoundError:
        value = ""
    if value:
        return Token(value, "file")
    value = secrets.token_urlsafe(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    os.replace(tmp, path)
    return Token(value, "generated")

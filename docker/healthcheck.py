"""Container health check: exit 0 when the control service answers ``GET /api/v1/health``.

Run by the images' HEALTHCHECK and by docker-compose.yml. Standard library only. It asks the
address the service listens on (``DLRM_VRGD_HOST`` / ``DLRM_VRGD_PORT``; a wildcard address is
asked on loopback); the health route needs no token.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request

TIMEOUT_S = 4.0


def health_url(environ: dict[str, str]) -> str:
    """The service's health URL from its ``DLRM_VRGD_*`` settings."""
    host = environ.get("DLRM_VRGD_HOST", "127.0.0.1").strip() or "127.0.0.1"
    if host in ("0.0.0.0", "::", "[::]"):
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    port = environ.get("DLRM_VRGD_PORT", "8000").strip() or "8000"
    return f"http://{host}:{port}/api/v1/health"


def main() -> int:
    url = health_url(dict(os.environ))
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            body = json.loads(response.read().decode())
    except (OSError, ValueError, urllib.error.URLError) as err:
        print(f"unhealthy: {url}: {err}", file=sys.stderr)
        return 1
    if body.get("status") != "ok":
        print(f"unhealthy: {url} answered {body}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the service shows of a text it did not write itself: no secret, no host path.

A job's ``error``, ``backend_state`` and log lines (``/logs``) pass :func:`shown`: URI
credentials and secret query values are masked (:func:`dlrm_vrgd.redact.redact`, the one
redaction the trainer uses too), and paths under the service's directories are shown relative
to the data directory: ``jobs/ID/run/...`` for a job's files, ``data/...`` for the score data
root, ``mlflow/...`` for the MLflow directory, whatever the host's absolute paths are. What
else the API echoes from a job (its config, result, events) is masked by ``redact``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from dlrm_vrgd.redact import redact
from service.settings import Settings


def _roots(settings: Settings) -> list[tuple[str, str]]:
    """(absolute directory, shown as) pairs, longest first, in both the configured and the
    resolved spelling of each directory."""
    named = [
        (settings.inputs_root, "data"),
        (settings.jobs_dir, "jobs"),
        (settings.mlflow_root, "mlflow"),
        (settings.data_dir, "."),
    ]
    pairs: dict[str, str] = {}
    for path, label in named:
        for spelling in (str(Path(path).absolute()), os.path.realpath(path)):
            pairs.setdefault(spelling.rstrip("/"), label)
    return sorted(pairs.items(), key=lambda p: -len(p[0]))


def relative_paths(text: str, settings: Settings) -> str:
    """``text`` with the service's absolute directories replaced by their relative names
    (``/srv/dlrm/jobs/ab/run/x`` -> ``jobs/ab/run/x``, ``/srv/dlrm`` -> ``.``)."""
    for root, label in _roots(settings):
        if root in text:
            pattern = re.escape(root) + r"(/|(?=[\s'\":,;)\]]|$))"
            below = "" if label == "." else f"{label}/"
            text = re.sub(pattern, lambda m, b=below, w=label: b if m.group(1) else w, text)
    return text


def shown(text: str, settings: Settings) -> str:
    """``text`` as the API may show it: secrets masked, paths relative."""
    return relative_paths(redact(text), settings)


def shown_obj(obj: Any, settings: Settings | None = None) -> Any:
    """:func:`redact` (and, with ``settings``, :func:`relative_paths`) on every string of a
    JSON-like value."""
    if isinstance(obj, str):
        return shown(obj, settings) if settings is not None else redact(obj)
    if isinstance(obj, dict):
        return {k: shown_obj(v, settings) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [shown_obj(v, settings) for v in obj]
    return obj

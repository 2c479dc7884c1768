"""The run directory as a tracking sink: the trainer's records into ``metrics.jsonl`` and
``gsnr.jsonl``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dlrm_vrgd.rundir.files import JsonlWriter
from dlrm_vrgd.rundir.layout import GSNR, METRICS


class RunDirSink:
    """The run directory as a :class:`dlrm_vrgd.tracking.Sink`: ``metrics.jsonl`` (the start
    record, step and eval records) and ``gsnr.jsonl``. ``result.json`` is written by the loop."""

    name = "run directory"

    def __init__(self, out: Path) -> None:
        self._metrics = JsonlWriter(Path(out) / METRICS)
        self._gsnr = JsonlWriter(Path(out) / GSNR)

    def start(self, record: dict[str, Any]) -> None:
        self._metrics.write(record)

    def metrics(self, record: dict[str, Any]) -> None:
        self._metrics.write(record)

    def gsnr(self, record: dict[str, Any]) -> None:
        self._gsnr.write(record)

    def model(self, model_dir: Path) -> None:
        pass  # the loop exports the model itself

    def result_fields(self) -> dict[str, Any]:
        return {}

    def finish(self, result: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        self._metrics.close()
        self._gsnr.close()

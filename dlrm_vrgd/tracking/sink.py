"""The one interface through which a run's records leave the training loop.

The loop hands every record it writes to a :class:`Sinks` group: the run directory (strict:
an error there fails the run) and the trackers (TensorBoard, MLflow; lenient: an error is
logged once, that tracker is dropped and training goes on). Trackers do their work on a
:class:`Worker` thread, so a step only pays for putting a record on a queue.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dlrm_vrgd.redact import redact
from dlrm_vrgd.tracking.scalars import WALL_TIME

logger = logging.getLogger(__name__)


class Sink:
    """Receives what the run directory receives, in the same order; every method optional.

    ``start(record)`` once (the ``kind: start`` record), ``metrics(record)`` for each
    ``metrics.jsonl`` record, ``gsnr(record)`` for each ``gsnr.jsonl`` record,
    ``model(path)`` once a model directory is exported (``train --export-model``),
    ``pr_curve(record, labels, probs)`` and ``histograms(step, arrays)`` at an eval (trackers),
    ``result_fields()`` for what to add to ``result.json``, ``finish(result)`` once
    ``result.json`` is written, and ``close()`` always (after a failure too).
    """

    name = "sink"

    def start(self, record: dict[str, Any]) -> None: ...

    def metrics(self, record: dict[str, Any]) -> None: ...

    def gsnr(self, record: dict[str, Any]) -> None: ...

    def model(self, model_dir: Path) -> None: ...

    def pr_curve(self, record: dict[str, Any], labels: Any, probs: Any) -> None: ...

    def histograms(self, step: int, arrays: dict[str, Any]) -> None: ...

    def result_fields(self) -> dict[str, Any]:
        return {}

    def finish(self, result: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class Sinks(Sink):
    """Fan-out to ``strict`` sinks (errors propagate) and ``lenient`` ones (logged, dropped)."""

    def __init__(self, strict: list[Any], lenient: list[Sink] | None = None) -> None:
        self.strict = list(strict)
        self.lenient = list(lenient or [])

    def _each(self, method: str, *args: Any) -> None:
        for sink in self.strict:
            getattr(sink, method)(*args)
        for sink in list(self.lenient):
            try:
                getattr(sink, method)(*args)
            except Exception as err:  # a tracker never fails training
                logger.warning(
                    "%s tracking failed (%s: %s); dropped", sink.name, type(err), redact(str(err))
                )
                self.lenient.remove(sink)
                _close_quietly(sink)

    def start(self, record: dict[str, Any]) -> None:
        self._each("start", stamped(record))

    def metrics(self, record: dict[str, Any]) -> None:
        self._each("metrics", stamped(record))

    def gsnr(self, record: dict[str, Any]) -> None:
        self._each("gsnr", stamped(record))

    def model(self, model_dir: Path) -> None:
        self._each("model", model_dir)

    def pr_curve(self, record: dict[str, Any], labels: Any, probs: Any) -> None:
        """An eval record's predictions (numpy ``labels``, ``probs``); trackers only."""
        self._each_tracker("pr_curve", record, labels, probs)

    def histograms(self, step: int, arrays: dict[str, Any]) -> None:
        """``tag -> values`` (numpy) at an eval step; trackers only."""
        self._each_tracker("histograms", step, arrays)

    def _each_tracker(self, method: str, *args: Any) -> None:
        strict, self.strict = self.strict, []
        try:
            self._each(method, *args)
        finally:
            self.strict = strict

    def result_fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for sink in self.strict + self.lenient:
            try:
                out.update(sink.result_fields())
            except Exception as err:
                logger.warning("%s tracking failed (%s)", sink.name, redact(str(err)))
        return out

    def finish(self, result: dict[str, Any]) -> None:
        self._each("finish", result)

    def close(self) -> None:
        for sink in self.lenient:
            _close_quietly(sink)
        for sink in self.strict:
            sink.close()


def stamped(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with its ``wall_time`` (Unix seconds, ms precision) added when it has none:
    the run directory keeps when each record was written, and every tracker uses that time."""
    if WALL_TIME in record:
        return record
    return {**record, WALL_TIME: round(time.time(), 3)}


def _close_quietly(sink: Sink) -> None:
    try:
        sink.close()
    except Exception as err:
        logger.warning("%s tracking failed while closing (%s)", sink.name, redact(str(err)))


class Worker:
    """A daemon thread that runs queued calls in order. The first call that raises is logged
    once (naming ``what``), and every later call is dropped: a tracker that fails stops
    tracking, the run goes on."""

    _STOP = object()

    def __init__(self, what: str) -> None:
        self.what = what
        self.failed: BaseException | None = None
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"dlrm-vrgd-{what}", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        if self.failed is None:
            self._queue.put((fn, args, False))

    def submit_always(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue a call that runs even after a failure (closing files)."""
        self._queue.put((fn, args, True))

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every call queued so far has run; False on timeout."""
        done = threading.Event()
        self._queue.put((done.set, (), True))
        return done.wait(timeout)

    def stop(self, timeout: float | None = None) -> None:
        self._queue.put(self._STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("%s: still busy after %.0f s; left behind", self.what, timeout or 0)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is self._STOP:
                return
            fn, args, always = item
            if self.failed is not None and not always:
                continue
            try:
                fn(*args)
            except Exception as err:
                if self.failed is not None:  # logged once already
                    logger.debug("%s: %s after the failure: %s", self.what, fn, redact(str(err)))
                    continue
                self.failed = err
                logger.warning(
                    "%s failed, and stops for this run (the run directory stays the record): "
                    "%s: %s",
                    self.what,
                    type(err).__name__,
                    redact(str(err)),
                )

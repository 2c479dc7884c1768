"""TensorBoard event files for a run: ``RUN/tb/events.out.tfevents.*``.

Written with tensorboardX's event-file writer and protobufs (numpy, packaging and protobuf
are its only dependencies; ``crc32c`` makes its record checksums native). Scalars follow
:mod:`dlrm_vrgd.tracking.scalars`; each record becomes one event holding all its values, so a
step with a hundred GSNR figures costs one write. The sink runs on its own thread: the training
step only puts the record on a queue. The file is flushed after every eval record, at the end,
and between evals every :data:`FLUSH_EVERY_S`. At the end, the hparams summary sets the
flattened config against the final metrics (TensorBoard's HParams tab compares a study's cells).

:func:`rebuild` writes the same events from a finished (or interrupted) run directory.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from dlrm_vrgd import rundir
from dlrm_vrgd.tracking import scalars as sc
from dlrm_vrgd.tracking.sink import Sink, Worker

logger = logging.getLogger(__name__)

TB_DIR = "tb"
#: Between evals, the live file is flushed at most this often (TensorBoard reloads ~30 s).
FLUSH_EVERY_S = 10.0
#: Thresholds of an eval's PR curve (TensorBoard's default).
PR_THRESHOLDS = 127
#: Buckets of a weight histogram (equal widths between its min and max).
HISTOGRAM_BINS = 64


class EventFile:
    """One TensorBoard event file; not thread-safe (one :class:`Worker` owns it)."""

    def __init__(self, logdir: Path) -> None:
        from tensorboardX.event_file_writer import EventsWriter

        logdir.mkdir(parents=True, exist_ok=True)
        # EventsWriter names the file events.out.tfevents.<time>.<host><suffix>; the suffix
        # keeps two writers started in the same second (rebuild, then a resumed run) apart.
        suffix = f".{time.time_ns() % 1_000_000_000:09d}"
        self._writer = EventsWriter(str(logdir / "events"), suffix)
        self.path = next(logdir.glob(f"events.out.tfevents.*{suffix}"))

    def scalars(self, values: list[sc.Scalar], wall_time: float) -> None:
        """One event per step: all values of a record that share a step."""
        from tensorboardX.proto.event_pb2 import Event

        events: dict[int, Any] = {}
        for tag, value, step in values:
            event = events.get(step)
            if event is None:
                event = events[step] = Event(wall_time=wall_time, step=step)
            event.summary.value.add(tag=tag, simple_value=value)
        for event in events.values():
            self._writer.write_event(event)

    def layout(self) -> None:
        """Charts that put AUC beside the oracle's, per split, the gradient noise scale
        beside the run's global batch, and the step's time beside the part of it spent waiting
        for input (TensorBoard's Custom Scalars)."""
        from tensorboardX.summary import custom_scalars

        charts = {
            split: {
                "AUC vs oracle": ["Multiline", [f"^{split}/auc$", f"^{split}/oracle_auc$"]],
                "logloss vs oracle": [
                    "Multiline",
                    [f"^{split}/logloss$", f"^{split}/oracle_logloss$"],
                ],
            }
            for split in ("val", "test")
        }
        charts["noise scale"] = {
            "B_simple vs the global batch G": [
                "Multiline",
                ["^noise_scale/(model|dense|tables)/b_simple$", "^noise_scale/global_batch$"],
            ],
        }
        charts["input"] = {
            "step time vs input wait (s)": [
                "Multiline",
                ["^train/step_seconds$", "^train/data_wait_s$"],
            ],
        }
        self._summary(custom_scalars(charts), 0, time.time())

    def hparams(self, config: dict[str, Any], result: dict[str, Any], wall_time: float) -> None:
        """The HParams plugin's experiment + session records, and the metric scalars."""
        from tensorboardX.summary import hparams

        params = {k: ("None" if v is None else v) for k, v in sc.flatten(config)}
        finals = sc.hparam_scalars(result)
        metrics = {tag: value for tag, value, _ in finals}
        for summary in hparams(params, metrics):
            self._summary(summary, 0, wall_time)
        self.scalars(finals, wall_time)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        """Flush and close. tensorboardX's ``EventsWriter.close`` flushes first and never closes
        the file when that flush fails (a full disk), leaving it to the garbage collector: the
        file is closed here whatever the flush does."""
        try:
            self._writer.flush()
        finally:
            self._writer._py_recordio_writer.close()

    def write_summary(self, summary: Any, step: int, wall_time: float) -> None:
        self._summary(summary, step, wall_time)

    def _summary(self, summary: Any, step: int, wall_time: float) -> None:
        from tensorboardX.proto.event_pb2 import Event

        self._writer.write_event(Event(wall_time=wall_time, step=step, summary=summary))


class TensorBoardSink(Sink):
    """Live event files for one run (rank 0 only: the loop gives sinks to rank 0)."""

    name = "TensorBoard"

    def __init__(self, logdir: Path, config: dict[str, Any]) -> None:
        self.config = config
        self._worker = Worker(f"TensorBoard writer ({logdir})")
        self._file: EventFile | None = None
        self._flushed = time.monotonic()
        self._worker.submit(self._open, Path(logdir))

    def _open(self, logdir: Path) -> None:
        self._file = EventFile(logdir)

    def start(self, record: dict[str, Any]) -> None:
        self._worker.submit(self._start)

    def _start(self) -> None:
        assert self._file is not None
        self._file.layout()

    def metrics(self, record: dict[str, Any]) -> None:
        self._worker.submit(self._metrics, record, sc.wall_time(record, time.time()))

    def gsnr(self, record: dict[str, Any]) -> None:
        self._worker.submit(self._gsnr, record, sc.wall_time(record, time.time()))

    def finish(self, result: dict[str, Any]) -> None:
        self._worker.submit(self._hparams, result, time.time())

    def pr_curve(self, record: dict[str, Any], labels: Any, probs: Any) -> None:
        """``pr/<split>`` (the PR Curves tab) at the eval's step. The summary (127 thresholds'
        counts: one pass over the predictions) is made here, so the queue holds no arrays."""
        from tensorboardX.summary import pr_curve

        split = str(record.get("split"))
        tag = f"pr/{sc.SPLIT_PREFIX.get(split, split)}"
        summary = pr_curve(tag, labels.astype(bool), probs, num_thresholds=PR_THRESHOLDS)
        wall = sc.wall_time(record, time.time())
        self._worker.submit(self._summary, summary, int(record["step"]), wall)

    def histograms(self, step: int, arrays: dict[str, Any]) -> None:
        """One histogram per array (the Histograms / Distributions tabs), made here."""
        from tensorboardX.summary import histogram

        summaries = [histogram(tag, values, bins=HISTOGRAM_BINS) for tag, values in arrays.items()]
        wall = time.time()
        for summary in summaries:
            self._worker.submit(self._summary, summary, step, wall)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every record handed over so far is written (benchmarks, tests)."""
        return self._worker.wait(timeout)

    def close(self) -> None:
        self._worker.submit_always(self._close)
        self._worker.stop(timeout=60)

    def _metrics(self, record: dict[str, Any], wall: float) -> None:
        assert self._file is not None
        self._file.scalars(sc.metric_scalars(record), wall)
        self._maybe_flush(record.get("kind") == "eval")

    def _gsnr(self, record: dict[str, Any], wall: float) -> None:
        assert self._file is not None
        self._file.scalars(sc.gsnr_scalars(record), wall)
        self._maybe_flush(False)

    def _summary(self, summary: Any, step: int, wall: float) -> None:
        assert self._file is not None
        self._file.write_summary(summary, step, wall)

    def _maybe_flush(self, now: bool) -> None:
        """At every eval, and between evals every :data:`FLUSH_EVERY_S` (a live view)."""
        assert self._file is not None
        if now or time.monotonic() - self._flushed >= FLUSH_EVERY_S:
            self._file.flush()
            self._flushed = time.monotonic()

    def _hparams(self, result: dict[str, Any], wall: float) -> None:
        assert self._file is not None
        self._file.hparams(self.config, result, wall)
        self._file.flush()

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()


def rebuild(run_dir: Path) -> Path:
    """Write ``RUN/tb/`` afresh from ``metrics.jsonl`` and ``gsnr.jsonl`` (and, for a finished
    run, the hparams summary from ``config.json`` + ``result.json``); returns the event file.

    Every event keeps its record's ``wall_time`` (when it was written), so TensorBoard's
    *relative* and *wall* axes show the run as it ran; records from before that field existed
    get the time of the rebuild.
    """
    run_dir = Path(run_dir)
    if not (run_dir / rundir.METRICS).exists():
        raise FileNotFoundError(f"{run_dir / rundir.METRICS}: not a run directory")
    logdir = run_dir / TB_DIR
    if logdir.exists():
        shutil.rmtree(logdir)
    events = EventFile(logdir)
    now = time.time()
    try:
        events.layout()
        # Live writing interleaves the two files by step; TensorBoard keys points by
        # (tag, step), so the order between the files does not change what it shows.
        last = now
        for record in _records(run_dir / rundir.METRICS):
            events.scalars(sc.metric_scalars(record), sc.wall_time(record, now))
            last = sc.wall_time(record, last)
        for record in _records(run_dir / rundir.GSNR):
            events.scalars(sc.gsnr_scalars(record), sc.wall_time(record, now))
        result_path = run_dir / rundir.RESULT
        if result_path.exists():
            result = json.loads(result_path.read_text())
            config = result.get("config")
            if config is None and (run_dir / rundir.CONFIG).exists():
                config = json.loads((run_dir / rundir.CONFIG).read_text())
            events.hparams(config or {}, result, last)
    finally:
        events.close()
    return events.path


def _records(path: Path) -> list[dict[str, Any]]:
    """The complete records of a JSON-lines file; a bad one is an error naming FILE:LINE."""
    if not path.exists():
        return []
    data = path.read_bytes()
    lines = data[: data.rfind(b"\n") + 1].splitlines()  # a torn last line is skipped
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or "step" not in record:
                raise ValueError("not a record with a step")
            int(record["step"])
        except (ValueError, TypeError) as err:
            raise ValueError(f"{path}:{number}: {err}") from None
        out.append(record)
    return out


def run_dirs(root: Path) -> list[Path]:
    """``root`` itself when it is a run directory, else every run directory below it (a
    study's cells); a study's own ``metrics.jsonl`` (cell records) is not a run's."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such directory")
    if (root / rundir.CONFIG).exists() and (root / rundir.METRICS).exists():
        return [root]
    found = sorted(
        p.parent for p in root.rglob(rundir.CONFIG) if (p.parent / rundir.METRICS).exists()
    )
    if not found:
        raise FileNotFoundError(f"{root}: holds no run directory (config.json + metrics.jsonl)")
    return found

"""Experiment tracking where users already look: TensorBoard event files in every run
directory (``run.tensorboard``), and an optional MLflow export (``run.mlflow``).

The training loop sees one :class:`~dlrm_vrgd.tracking.sink.Sink`; :func:`run_sinks` builds it
for a run: the run directory (strict) plus the trackers its config asks for (lenient).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from dlrm_vrgd.config import TrainConfig
from dlrm_vrgd.tracking.sink import Sink, Sinks, Worker

logger = logging.getLogger(__name__)

__all__ = ["Sink", "Sinks", "Worker", "run_sinks", "trackers"]


def trackers(cfg: TrainConfig, out: Path, resumed: bool) -> list[Sink]:
    """The trackers ``cfg.run`` asks for, writing for the run directory ``out`` (rank 0).

    A resumed run first rebuilds ``tb/`` from its (truncated) records, so the steps the
    interrupted run wrote after its checkpoint do not show twice.
    """
    out = Path(out)
    sinks: list[Sink] = []
    config = cfg.to_dict()
    if cfg.run.tensorboard:
        from dlrm_vrgd.tracking import tensorboard_sink as tb

        logdir = out / tb.TB_DIR
        try:
            if resumed:
                tb.rebuild(out)
            elif logdir.exists():
                shutil.rmtree(logdir)
            sinks.append(tb.TensorBoardSink(logdir, config))
        except Exception as err:  # tracking never stops a run
            logger.warning("TensorBoard: not writing %s (%s: %s)", logdir, type(err).__name__, err)
    if cfg.run.mlflow is not None:
        from dlrm_vrgd.tracking.mlflow_sink import MlflowSink

        sinks.append(MlflowSink(cfg.run.mlflow, out, config))
    return sinks


def run_sinks(cfg: TrainConfig, out: Path, resumed: bool) -> Sinks:
    """The run directory's writer and the trackers, as one sink."""
    from dlrm_vrgd.rundir import RunDirSink

    return Sinks([RunDirSink(Path(out))], trackers(cfg, out, resumed))

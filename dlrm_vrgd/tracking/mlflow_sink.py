"""Export a run to MLflow (optional: ``pip install 'dlrm-vrgd[tracking]'``).

Params are the flattened config (``optim.dense.lr``), metrics the series of
:mod:`dlrm_vrgd.tracking.scalars` (the same tags as TensorBoard's), sent with ``log_batch``
in batches (at most 1000 values, at every eval and at the end, else every
:data:`SEND_EVERY_S`). At the end ``result.json`` and ``config.json`` become artifacts and the
MLflow run id is stored in ``result.json`` (``mlflow.run_id``). With ``--export-model`` the model
directory becomes the run's ``model`` artifact and, with ``run.mlflow.register_model: NAME``, a
new version of registered model NAME (:func:`log_model`; ``dlrm-vrgd export`` does the same for
a run exported later). A study is one parent run
(params: the study config; artifacts: its plots and tables) whose children are the cells.

Every call to the tracking server runs on the sink's own thread. When the server cannot be
reached, the failure is logged once, tracking stops for that run and training goes on: the run
directory stays the record. A new experiment on a ``sqlite:///`` store keeps its artifacts beside
the database (:func:`artifact_location`), not in MLflow's default ``./mlruns``.
HTTP retries are bounded (MLflow's own default retries for minutes):
``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` and ``MLFLOW_HTTP_REQUEST_TIMEOUT`` default to
:data:`HTTP_RETRIES` and :data:`HTTP_TIMEOUT_S` unless set in the environment.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from dlrm_vrgd.config import MlflowConfig
from dlrm_vrgd.redact import redact
from dlrm_vrgd.tracking import scalars as sc
from dlrm_vrgd.tracking.sink import Sink, Worker

logger = logging.getLogger(__name__)

HTTP_RETRIES = 2
HTTP_TIMEOUT_S = 10
SEND_EVERY_S = 15.0
#: MLflow's log_batch limits: 1000 metrics, 100 params per call.
MAX_METRICS, MAX_PARAMS = 1000, 100
#: Bound on how long the end of a run waits for the tracking server.
END_WAIT_S = 120.0


def _import_mlflow() -> None:
    """Import what the sink's worker uses (a no-op once imported; an ImportError is raised where
    :func:`_client` reports it, on the worker)."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # no usage reports from a trainer
    try:
        import mlflow.entities  # noqa: F401
        import mlflow.tracking  # noqa: F401
    except ImportError:
        pass


def _client(cfg: MlflowConfig) -> Any:
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", str(HTTP_RETRIES))
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(HTTP_TIMEOUT_S))
    try:
        from mlflow.tracking import MlflowClient
    except ImportError as err:
        raise RuntimeError(
            "run.mlflow is set but MLflow is not installed: pip install 'dlrm-vrgd[tracking]'"
        ) from err
    return MlflowClient(tracking_uri=cfg.tracking_uri)


def artifact_location(cfg: MlflowConfig) -> str | None:
    """Where a new experiment keeps its artifacts: ``cfg.artifact_location``, else for a
    ``sqlite:///PATH`` store the folder ``STEM-artifacts`` beside the database (MLflow's own
    default is ``./mlruns`` in whatever directory the job runs in), else None (the server
    decides; a ``file:`` store keeps them inside the store)."""
    if cfg.artifact_location is not None:
        return cfg.artifact_location
    uri = cfg.tracking_uri
    if uri.lower().startswith("sqlite:///"):
        db = uri[len("sqlite:///") :]  # SQLAlchemy: relative to the working directory
        if db and db != ":memory:":
            path = Path(db).resolve()
            return (path.parent / f"{path.stem}-artifacts").as_uri()
    return None


def _experiment_id(client: Any, cfg: MlflowConfig) -> str:
    experiment = client.get_experiment_by_name(cfg.experiment)
    if experiment is not None:
        return str(experiment.experiment_id)
    return str(client.create_experiment(cfg.experiment, artifact_location=artifact_location(cfg)))


#: The run's artifact folder that holds the exported model directory.
MODEL_ARTIFACT = "model"


def log_model(client: Any, run_id: str, model_dir: Path, name: str | None) -> dict[str, Any]:
    """Log the model directory ``model_dir`` (``dlrm-vrgd export``) as the run's ``model``
    artifact and, with ``name``, register it as a new version of that registered model (created
    if missing). Returns the fields ``result.json`` keeps under ``mlflow``: ``model_uri`` and
    ``registered_model`` (name, version), or ``registry_error`` when the store has no registry
    (the artifact stays logged)."""
    client.log_artifacts(run_id, str(model_dir), artifact_path=MODEL_ARTIFACT)
    uri = f"runs:/{run_id}/{MODEL_ARTIFACT}"
    out: dict[str, Any] = {"model_uri": uri}
    if name is None:
        return out
    from mlflow.exceptions import MlflowException

    source = f"{client.get_run(run_id).info.artifact_uri.rstrip('/')}/{MODEL_ARTIFACT}"
    try:
        try:
            client.create_registered_model(name)
        except MlflowException as err:
            if err.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        version = client.create_model_version(name, source, run_id=run_id)
    except Exception as err:  # no registry (a plain file store, a server without one)
        logger.warning(
            "MLflow: the model is logged as %s but not registered as %r (%s: %s)",
            uri,
            name,
            type(err).__name__,
            redact(str(err)),
        )
        out["registry_error"] = redact(f"{type(err).__name__}: {err}")
        return out
    logger.info("MLflow: registered %s as %r version %s", uri, name, version.version)
    out["registered_model"] = {"name": name, "version": int(version.version)}
    return out


def log_params(client: Any, run_id: str, params: dict[str, Any]) -> None:
    from mlflow.entities import Param

    items = [Param(k, "None" if v is None else str(v)) for k, v in params.items()]
    for i in range(0, len(items), MAX_PARAMS):
        client.log_batch(run_id, params=items[i : i + MAX_PARAMS])


class MlflowSink(Sink):
    """One MLflow run for one training run (rank 0 only)."""

    name = "MLflow"

    def __init__(self, cfg: MlflowConfig, run_dir: Path, config: dict[str, Any]) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.config = config
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self._model: dict[str, Any] = {}
        self._model_queued = False
        self._client: Any = None
        self._pending: list[Any] = []
        self._last_send = time.monotonic()
        self._opened = threading.Event()
        self._finished = False
        # MLflow is imported here, on the caller's thread, before the worker starts: importing
        # it on the worker while the training thread imports torch's modules has hung runs
        # (twice in CI: the store never created, the run stuck after its last step)
        _import_mlflow()
        self._worker = Worker(f"MLflow export to {redact(cfg.tracking_uri)}")
        self._worker.submit(self._open)

    # ------------------------------------------------------------------ the loop's side
    def metrics(self, record: dict[str, Any]) -> None:
        self._worker.submit(self._add, sc.metric_scalars, record, record.get("kind") == "eval")

    def gsnr(self, record: dict[str, Any]) -> None:
        self._worker.submit(self._add, sc.gsnr_scalars, record, False)

    def model(self, model_dir: Path) -> None:
        self._model_queued = True
        self._worker.submit(self._log_model, Path(model_dir))

    def result_fields(self) -> dict[str, Any]:
        self._opened.wait(END_WAIT_S)
        if self._model_queued and not self._worker.wait(END_WAIT_S):
            logger.warning("MLflow: the model is still uploading; result.json will not name it")
        out: dict[str, Any] = {"tracking_uri": redact(self.cfg.tracking_uri)}
        if self.run_id is not None:
            out.update(experiment_id=self.experiment_id, run_id=self.run_id, **self._model)
        else:
            failed = self._worker.failed
            out["error"] = redact(f"{type(failed).__name__}: {failed}") if failed else "not started"
        return {"mlflow": out}

    def finish(self, result: dict[str, Any]) -> None:
        self._worker.submit(self._finish)

    def close(self) -> None:
        self._worker.submit(self._terminate, "FAILED")
        self._worker.stop(timeout=END_WAIT_S)

    # ---------------------------------------------------------------- the worker's side
    def _open(self) -> None:
        try:
            client = _client(self.cfg)
            self.experiment_id = _experiment_id(client, self.cfg)
            tags = {"dlrm_vrgd.run_dir": str(self.run_dir.resolve())}
            parent = self.cfg.parent_run_id
            if parent:
                tags["mlflow.parentRunId"] = parent
            run = client.create_run(
                self.experiment_id,
                run_name=self.cfg.run_name or self.run_dir.name,
                tags=tags,
            )
            log_params(client, run.info.run_id, dict(sc.flatten(self.config)))
            self._client, self.run_id = client, run.info.run_id
            logger.info("MLflow run %s at %s", self.run_id, redact(self.cfg.tracking_uri))
        finally:
            self._opened.set()

    def _add(self, series: Any, record: dict[str, Any], send: bool) -> None:
        from mlflow.entities import Metric

        stamp = int(sc.wall_time(record, time.time()) * 1000)
        self._pending += [Metric(tag, value, stamp, step) for tag, value, step in series(record)]
        if send or len(self._pending) >= MAX_METRICS or self._due():
            self._send()

    def _log_model(self, model_dir: Path) -> None:
        self._model = log_model(self._client, str(self.run_id), model_dir, self.cfg.register_model)

    def _due(self) -> bool:
        return time.monotonic() - self._last_send >= SEND_EVERY_S

    def _send(self) -> None:
        pending, self._pending = self._pending, []
        for i in range(0, len(pending), MAX_METRICS):
            self._client.log_batch(self.run_id, metrics=pending[i : i + MAX_METRICS])
        self._last_send = time.monotonic()

    def _finish(self) -> None:
        self._send()
        for name in ("result.json", "config.json"):
            if (self.run_dir / name).exists():
                self._client.log_artifact(self.run_id, str(self.run_dir / name))
        self._client.set_terminated(self.run_id, "FINISHED")
        self._finished = True

    def _terminate(self, status: str) -> None:
        if not self._finished and self._client is not None:
            self._send()
            self._client.set_terminated(self.run_id, status)
            self._finished = True


# ------------------------------------------------------------------------------ studies
STUDY_RUN = "mlflow.json"
STUDY_ARTIFACTS = ("results.json", "results.csv", "results.md", "study.json")


def study_parent_run(cfg: MlflowConfig, study_dir: Path, study: dict[str, Any]) -> str | None:
    """The study's parent MLflow run (created once; its id kept in ``STUDY/mlflow.json`` so a
    resumed study adds to it); None, logged once, when the server cannot be reached."""
    from dlrm_vrgd.rundir import atomic_write_json

    saved = study_dir / STUDY_RUN
    if saved.exists():
        stored = json.loads(saved.read_text())
        if stored.get("tracking_uri") == redact(cfg.tracking_uri) and stored.get("run_id"):
            return str(stored["run_id"])
    try:
        client = _client(cfg)
        run = client.create_run(
            _experiment_id(client, cfg),
            run_name=cfg.run_name or f"study {study.get('name', study_dir.name)}",
            tags={"dlrm_vrgd.study_dir": str(study_dir.resolve())},
        )
        log_params(client, run.info.run_id, dict(sc.flatten(study)))
    except Exception as err:
        logger.warning(
            "MLflow at %s: cannot start the study's run (%s: %s); the study goes on without it",
            redact(cfg.tracking_uri),
            type(err).__name__,
            redact(str(err)),
        )
        return None
    atomic_write_json(saved, {"tracking_uri": redact(cfg.tracking_uri), "run_id": run.info.run_id})
    return str(run.info.run_id)


def log_study_report(cfg: MlflowConfig, run_id: str, study_dir: Path) -> None:
    """The study's tables and plots as artifacts of its parent run; then it is finished."""
    try:
        client = _client(cfg)
        for path in sorted(study_dir.iterdir()):
            if path.name in STUDY_ARTIFACTS or path.suffix == ".png":
                client.log_artifact(run_id, str(path))
        client.set_terminated(run_id, "FINISHED")
    except Exception as err:
        logger.warning(
            "MLflow at %s: the study's report was not exported (%s: %s)",
            redact(cfg.tracking_uri),
            type(err).__name__,
            redact(str(err)),
        )

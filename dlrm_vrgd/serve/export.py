"""``dlrm-vrgd export``: a training checkpoint -> a device-independent model directory.

Reads any checkpoint of a run (one rank or several; tables whole or sharded table-wise or
column-wise; FBGEMM or torch embedding backend): every rank's file is verified against the
checkpoint's manifest (size and SHA-256) and the tables are reassembled
(:func:`~dlrm_vrgd.checkpoint.reshard.gather_checkpoint`). The dense parameters are mapped onto
:class:`~dlrm_vrgd.serve.model.ScoringModel` by position (torchrec's DLRM and the torch backend
register the same layers in the same order; every shape is checked). The directory
(layout in :mod:`dlrm_vrgd.serve.model`) is written under a hidden name next to ``--out`` and
renamed into place when complete, manifest last.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from dlrm_vrgd import checkpoint as ckpt
from dlrm_vrgd.checkpoint.reshard import FullState, gather_checkpoint
from dlrm_vrgd.config import parse_config
from dlrm_vrgd.serve import model as m
from dlrm_vrgd.serve.features import FeatureError, layout_of_run
from dlrm_vrgd.serve.featurizer import RawFeaturizer, RawScoringModel

logger = logging.getLogger(__name__)


class ExportError(ValueError):
    """A run or checkpoint that cannot be exported (the message says why)."""


@dataclass
class ExportResult:
    out: Path
    step: int
    world_size: int
    manifest: dict[str, Any]


def find_checkpoint(run_dir: Path, step: int | None) -> Path:
    """Checkpoint ``step`` of a run (default: the newest)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ExportError(f"{run_dir}: no such run directory")
    found = ckpt.list_checkpoints(run_dir)
    if not found:
        raise ExportError(
            f"{run_dir}: no checkpoint: the run has not finished, or stopped before its first "
            f"checkpoint{_stopped(run_dir)} (a finished run leaves the checkpoints of its last "
            "and its best step; run.checkpoint_every / checkpoint_every_s also checkpoint "
            "during training, so that an interrupted run can be resumed or exported)"
        )
    if step is None:
        return found[-1]
    for path in found:
        if path.name == f"step_{step:08d}":
            return path
    steps = ", ".join(str(int(p.name.removeprefix("step_"))) for p in found)
    raise ExportError(f"{run_dir}: no checkpoint of step {step} (there are: {steps})")


def _stopped(run_dir: Path) -> str:
    """``" (status.json: interrupted at step 7)"`` when the run's status.json says how it
    stopped, else ``""`` (a file that is not what it should be says nothing)."""
    try:
        with (run_dir / "status.json").open("rb") as f:
            status = json.loads(f.read(64 << 10))
        state, step = status["state"], status["step"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return ""
    if not isinstance(state, str) or not isinstance(step, int) or not state.isalpha():
        return ""
    return f" (status.json: {state} at step {step})"


def scoring_model(full: FullState, bag_sizes: list[int] | None = None) -> m.ScoringModel:
    """A :class:`ScoringModel` holding the checkpoint's weights (``bag_sizes``: of a
    multi-hot model, whose rows are the bags of its tables side by side)."""
    cfg = parse_config(full.config, "checkpoint config")
    tables = list(full.tables.values())
    dims = {t.dim for t in tables}
    if dims != {cfg.model.embedding_dim}:
        raise ExportError(f"tables of dims {sorted(dims)}, config says {cfg.model.embedding_dim}")
    dense = list(full.dense.items())
    num_dense = int(dense[0][1].shape[1])
    arch = arch_of(cfg.to_dict(), [t.rows for t in tables], num_dense, bag_sizes)
    model = m.ScoringModel(**arch)
    params = list(model.named_parameters())
    if len(params) != len(dense):
        raise ExportError(f"checkpoint has {len(dense)} dense tensors, the model {len(params)}")
    with torch.no_grad():
        for (name, p), (saved, value) in zip(params, dense, strict=True):
            if tuple(p.shape) != tuple(value.shape):
                raise ExportError(
                    f"dense tensor {saved} is {tuple(value.shape)}, {name} is {tuple(p.shape)}"
                )
            p.copy_(value)
        model.weight.copy_(torch.cat([t.weight for t in tables]))
    return model.eval()


def arch_of(
    config: dict[str, Any],
    table_rows: list[int],
    num_dense: int,
    bag_sizes: list[int] | None = None,
) -> dict[str, Any]:
    """``model.json``: ScoringModel's arguments (``bag_sizes`` only for a multi-hot model)."""
    mc = config["model"]
    bags = {} if bag_sizes is None else {"bag_sizes": [int(b) for b in bag_sizes]}
    return {
        "arch": mc["arch"],
        "table_rows": table_rows,
        "embedding_dim": mc["embedding_dim"],
        "num_dense": num_dense,
        "dense_arch": list(mc["dense_arch"]),
        "over_arch": list(mc["over_arch"]),
        "dcn_num_layers": mc["dcn_num_layers"],
        "dcn_low_rank_dim": mc["dcn_low_rank_dim"],
        **bags,
    }


def export_program(
    model: torch.nn.Module, path: Path, num_tables: int | None = None, raw: bool = False
) -> None:
    """``torch.export`` of the scoring module (``raw``: of :class:`RawScoringModel`, whose
    inputs are the raw integers) with a dynamic batch dimension."""
    n = 4
    if raw:
        args = (
            torch.zeros(n, 13, dtype=torch.int64),
            torch.zeros(n, num_tables, dtype=torch.int64),
        )
        names = ("dense_raw", "ids_raw")
    else:
        assert isinstance(model, m.ScoringModel)
        dense = torch.zeros(n, model.dense_arch[0].in_features)
        args = (dense, torch.zeros(n, model.width, dtype=torch.int64))
        names = ("dense", "sparse")
    batch = torch.export.Dim("batch", min=1, max=1 << 30)
    program = torch.export.export(model, args, dynamic_shapes={k: {0: batch} for k in names})
    _save(path, lambda f: torch.export.save(program, f))


def export_model(
    run_dir: str | Path,
    out: str | Path,
    step: int | None = None,
    *,
    program: bool = True,
    overwrite: bool = False,
    onnx: bool = False,
    external_bytes: int | None = None,
) -> ExportResult:
    """Write the model directory ``out`` from checkpoint ``step`` (default newest) of a run;
    ``program``: the ``torch.export`` programs; ``onnx``: the ONNX graphs and a Triton
    repository (:mod:`dlrm_vrgd.serve.onnx`; tensors over ``external_bytes`` to external
    data)."""
    run_dir, out = Path(run_dir), Path(out).absolute()
    _check_out(out, overwrite)
    path = find_checkpoint(run_dir, step)
    try:
        full = gather_checkpoint(path)
    except ckpt.CheckpointError as err:
        raise ExportError(f"cannot export: {err}") from None
    cfg = parse_config(full.config, "checkpoint config")
    table_rows = [t.rows for t in full.tables.values()]
    num_dense = int(next(iter(full.dense.values())).shape[1])
    try:
        layout, vocab = layout_of_run(cfg, table_rows, num_dense)
    except FeatureError as err:
        raise ExportError(f"cannot export: {err}") from None
    model = scoring_model(full, layout.multi_hot_sizes)

    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        arch = arch_of(full.config, model.table_rows, num_dense, model.bag_sizes)
        _write_json(staging / m.ARCH, arch)
        _write_json(staging / m.CONFIG, full.config)
        _write_json(staging / m.FEATURES, layout.to_dict())
        _save(staging / m.WEIGHTS, lambda f: torch.save(model.state_dict(), f))
        if vocab is not None:
            np.save(staging / m.VOCAB, vocab)
        if program:
            export_program(model, staging / m.PROGRAM)
            if layout.raw_graph:  # the input transform in the graph: raw integers in
                raw = RawScoringModel(RawFeaturizer(layout, vocab), model)
                export_program(raw, staging / m.RAW_PROGRAM, len(model.table_rows), raw=True)
        if onnx:
            from dlrm_vrgd.serve import onnx as ox

            limit = ox.EXTERNAL_DATA_BYTES if external_bytes is None else external_bytes
            ox.write_onnx(staging, model, layout, vocab, ox.triton_name(out), limit)
        written = sorted(f for f in staging.rglob("*") if f.is_file())
        files = {
            f.relative_to(staging).as_posix(): {"bytes": f.stat().st_size,
                                                "sha256": m.sha256_file(f)}
            for f in written
        }  # fmt: skip
        manifest = {
            "format": m.MODEL_FORMAT,
            "version": m.MODEL_VERSION,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "run": str(run_dir.absolute()),
            "checkpoint": path.name,
            "step": full.step,
            "world_size": full.world_size,
            "torch": torch.__version__,
            "files": files,
        }
        _write_json(staging / m.MANIFEST, manifest)
        for f in [*written, staging / m.MANIFEST]:
            _fsync(f)
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
            os.replace(staging, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, out)
    except OSError as err:  # a full disk, a quota: nothing half-written stays
        shutil.rmtree(staging, ignore_errors=True)
        if err.errno is None:
            raise
        raise OSError(
            err.errno, f"cannot write the model {out}: {err.strerror}; nothing was written"
        ) from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("exported %s (step %d, %d rank(s)) to %s", path, full.step, full.world_size, out)
    return ExportResult(out, full.step, full.world_size, manifest)


def _check_out(out: Path, overwrite: bool) -> None:
    """``out`` may be written: absent, or (with ``overwrite``) a model directory (as
    ``preprocess`` does, a directory of anything else is never replaced)."""
    if not out.exists() and not out.is_symlink():
        return
    if out.is_dir() and not out.is_symlink() and not any(out.iterdir()):
        return  # an empty directory (made for it)
    if not overwrite:
        raise FileExistsError(f"{out} exists: pass --overwrite or another --out")
    if out.is_symlink() or not out.is_dir():
        raise FileExistsError(f"refusing to replace {out}: it is not a directory")
    try:
        m.read_manifest(out, verify=False)
    except m.ModelError:
        raise FileExistsError(
            f"refusing to replace {out}: it has no valid {m.MANIFEST}, so it is not a model "
            "directory of dlrm-vrgd export"
        ) from None


class _Sink(io.RawIOBase):
    """A file for torch's writers that keeps the OSError of a failed write (torch reports only
    a RuntimeError of its own)."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.error: OSError | None = None

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.f.seek(offset, whence)

    def tell(self) -> int:
        return self.f.tell()

    def write(self, b: Any) -> int:
        try:
            return self.f.write(b)
        except OSError as err:
            self.error = err
            raise


def _save(path: Path, write: Callable[[Any], None]) -> None:
    with path.open("wb") as f:
        sink = _Sink(f)
        try:
            write(sink)
        except RuntimeError:
            if sink.error is not None:
                raise sink.error from None
            raise


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def _fsync(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())

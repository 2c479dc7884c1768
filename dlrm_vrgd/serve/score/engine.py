"""Which forward ``dlrm-vrgd score`` runs: ONNX Runtime on ``model.onnx`` or the torch module.

``auto`` is ONNX Runtime where the model directory lists ``model.onnx`` and the device is the
CPU. With ONNX Runtime, ``weights.pt`` is verified as the torch engine verifies it (its
SHA-256, its exact tensors, all finite), memory-mapped and let go: the whole model directory
is checked whichever engine scores.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from dlrm_vrgd.serve import model as m
from dlrm_vrgd.serve.features import FeatureLayout

logger = logging.getLogger(__name__)

#: The model's forward: ``auto`` is onnxruntime where the model has ``model.onnx`` (on CPU).
Engine = Literal["auto", "onnxruntime", "torch"]
#: ``(dense B x 13 float32, sparse B x 26 int64 table rows)`` -> ``B`` probabilities
Predict = Callable[[np.ndarray, np.ndarray], np.ndarray]


def resolve_engine(
    model_dir: str | Path, engine: Engine, device: str
) -> Literal["onnxruntime", "torch"]:
    """The forward ``score`` runs: ONNX Runtime on ``model.onnx`` (``onnxruntime``, or
    ``auto`` with the file listed and ``device`` cpu), else the torch module."""
    if engine not in ("auto", "onnxruntime", "torch"):
        raise ValueError(f"--engine {engine!r}: not auto, onnxruntime or torch")
    if engine == "torch":
        return "torch"
    has_onnx = m.ONNX in m.read_manifest(Path(model_dir), verify=False)["files"]
    if engine == "onnxruntime" or (engine == "auto" and has_onnx and device == "cpu"):
        if not has_onnx:
            raise m.ModelError(
                f"{model_dir}: no {m.ONNX} for --engine onnxruntime (export it with --format "
                "onnx or all, or pass --engine torch)"
            )
        return "onnxruntime"
    return "torch"


def load_engine(
    model_dir: str | Path, engine: Engine, device: str, batch_rows: int, threads: int | None
) -> tuple[Predict, FeatureLayout, np.ndarray | None]:
    """The chosen forward with the model's feature layout and vocabulary, every file of
    ``model_dir`` verified once."""
    chosen = resolve_engine(model_dir, engine, device)
    if chosen == "onnxruntime":
        # OnnxScorer verifies every file (model.onnx as it reads it); weights.pt is hashed,
        # then checked memory-mapped as the torch loader checks it (load_features) and let
        # go: ONNX Runtime holds the tables, once
        predict = predictor(model_dir, None, chosen, device, batch_rows, threads)
        layout, vocab = m.load_features(model_dir, verify=False)
        return predict, layout, vocab
    model, layout, vocab = m.load_scoring(model_dir, device)
    predict = predictor(model_dir, model, chosen, device, batch_rows, threads, verify=False)
    return predict, layout, vocab


def predictor(
    model_dir: str | Path,
    model: m.ScoringModel | None,
    engine: Engine,
    device: str,
    batch_rows: int,
    threads: int | None = None,
    verify: bool = True,
) -> Predict:
    """The forward of :func:`resolve_engine`: an :class:`~dlrm_vrgd.serve.onnx.OnnxScorer`,
    or the torch module ``model`` (loaded from ``model_dir`` when None). ``verify=False``: the
    caller has just verified every file of ``model_dir`` (ONNX Runtime's bytes are checked
    against the manifest all the same)."""
    if resolve_engine(model_dir, engine, device) == "onnxruntime":
        from dlrm_vrgd.serve.onnx import OnnxScorer

        logger.info("scoring with onnxruntime (%s)", m.ONNX)
        return OnnxScorer(model_dir, device=device, batch_rows=batch_rows, threads=threads,
                          verify=verify)  # fmt: skip
    torch_model = model if model is not None else m.load_model(model_dir, device, verify)
    return lambda dense, sparse: _predict(torch_model, dense, sparse, batch_rows, device)


@torch.no_grad()
def _predict(
    model: m.ScoringModel, dense: np.ndarray, sparse: np.ndarray, batch_rows: int, device: str
) -> np.ndarray:
    """``B`` probabilities of ``dense`` (``B x 13``) and ``sparse`` (``B x 26``), ``batch_rows``
    rows per forward."""
    out = np.empty(len(dense), dtype=np.float32)
    for a in range(0, len(dense), batch_rows):
        d = torch.from_numpy(np.ascontiguousarray(dense[a : a + batch_rows], dtype=np.float32))
        s = torch.from_numpy(np.ascontiguousarray(sparse[a : a + batch_rows], dtype=np.int64))
        out[a : a + batch_rows] = model(d.to(device), s.to(device)).float().cpu().numpy()
    return out

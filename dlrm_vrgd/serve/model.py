"""The scoring module of an exported model, and loading a model directory (plain PyTorch).

:class:`ScoringModel` is the trained click model for inference: ``forward(dense, sparse)`` with
``dense`` ``B x 13`` float32 (already transformed, as in the day files) and ``sparse`` ``B x 26``
int64 table-local row ids gives ``B`` click probabilities. Its layers are those of
:mod:`dlrm_vrgd.torch_model` (which mirrors torchrec's DLRM / DLRM_DCN exactly); the tables are
one ``Σrows x D`` buffer read with ``index_select`` (one id per table and row: sum pooling of a
single id is the row itself). Nothing here imports torchrec or FBGEMM.

A model directory (written by :mod:`dlrm_vrgd.serve.export`)::

    MODEL/
      manifest.json   format, version, source run and step, and bytes + SHA-256 of every file
      model.json      architecture (ScoringModel's arguments)
      config.json     the training run's TrainConfig
      features.json   how a raw Criteo row becomes model inputs (serve/features.py)
      weights.pt      state dict of ScoringModel (tensors only: torch.load(weights_only=True))
      vocab.npy       kept ids per table (only for data preprocessed with a frequency threshold)
      model.pt2       torch.export program of ScoringModel (dynamic batch size)
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dlrm_vrgd.torch_model import LowRankCrossNet, mlp

MODEL_FORMAT = "dlrm-vrgd/model"
MODEL_VERSION = 1
MANIFEST = "manifest.json"
ARCH = "model.json"
CONFIG = "config.json"
FEATURES = "features.json"
WEIGHTS = "weights.pt"
VOCAB = "vocab.npy"
PROGRAM = "model.pt2"


class ModelError(ValueError):
    """A model directory that is missing, incomplete or altered."""


class ScoringModel(nn.Module):
    """DLRM or DLRM_DCN for inference (see the module docstring)."""

    def __init__(
        self,
        arch: str,
        table_rows: list[int],
        embedding_dim: int,
        num_dense: int,
        dense_arch: list[int],
        over_arch: list[int],
        dcn_num_layers: int = 3,
        dcn_low_rank_dim: int = 16,
        meta_tables: bool = False,
    ) -> None:
        super().__init__()
        if arch not in ("dlrm", "dlrm_dcn"):
            raise ModelError(f"model.json: arch {arch!r} is not dlrm or dlrm_dcn")
        self.arch = arch
        self.table_rows = [int(r) for r in table_rows]
        num_sparse, dim = len(self.table_rows), embedding_dim
        starts = torch.tensor([0, *self.table_rows[:-1]], dtype=torch.int64).cumsum(0)
        self.register_buffer("row_offsets", starts)
        # meta_tables: no storage for the tables, for loading them with assign=True
        weight = torch.empty(sum(self.table_rows), dim, device="meta" if meta_tables else None)
        self.register_buffer("weight", weight if meta_tables else weight.zero_())
        self.dense_arch = mlp([num_dense, *dense_arch])
        if arch == "dlrm":
            # the upper triangle (no diagonal) of the N x N dot products, as flat positions:
            # index_select of them is ~2x faster than advanced indexing by (rows, cols)
            triu = torch.triu_indices(num_sparse + 1, num_sparse + 1, offset=1)
            flat = triu[0] * (num_sparse + 1) + triu[1]
            self.register_buffer("triu_flat", flat, persistent=False)
            over_in = dim + (num_sparse + 1) * num_sparse // 2
        else:
            self.crossnet = LowRankCrossNet(
                (num_sparse + 1) * dim, dcn_num_layers, dcn_low_rank_dim
            )
            over_in = (num_sparse + 1) * dim
        sizes = [over_in, *over_arch]
        self.over_arch = nn.Sequential(mlp(sizes[:-1]), nn.Linear(sizes[-2], sizes[-1]))

    def tables(self) -> list[torch.Tensor]:
        """Views of the embedding tables, one ``rows x D`` tensor each."""
        return list(self.weight.split(self.table_rows))

    def logits(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        n, t = sparse.shape
        rows = (sparse + self.row_offsets).reshape(-1)
        emb = self.weight.index_select(0, rows).view(n, t, -1)  # B x T x D
        d = self.dense_arch(dense)
        combined = torch.cat([d.unsqueeze(1), emb], dim=1)
        if self.arch == "dlrm":
            dots = torch.bmm(combined, combined.transpose(1, 2)).flatten(1)
            dots = dots.index_select(1, self.triu_flat)
            features = torch.cat([d, dots], dim=1)
        else:
            features = self.crossnet(combined.reshape(n, -1))
        return self.over_arch(features).squeeze(-1)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.logits(dense, sparse))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_manifest(model_dir: Path, verify: bool = True) -> dict[str, Any]:
    """The manifest of a model directory; with ``verify``, every file's size and SHA-256."""
    model_dir = Path(model_dir)
    path = model_dir / MANIFEST
    if not model_dir.is_dir():
        raise ModelError(f"{model_dir}: not a directory (pass the --out of `dlrm-vrgd export`)")
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelError(f"{path}: missing; not a complete `dlrm-vrgd export` output") from None
    except json.JSONDecodeError as err:
        raise ModelError(f"{path}: not valid JSON: {err}") from None
    if manifest.get("format") != MODEL_FORMAT or manifest.get("version") != MODEL_VERSION:
        raise ModelError(
            f"{path}: format {manifest.get('format')!r} version {manifest.get('version')!r}; "
            f"expected {MODEL_FORMAT!r} version {MODEL_VERSION}"
        )
    if verify:
        for name, meta in manifest["files"].items():
            f = model_dir / name
            if not f.is_file():
                raise ModelError(f"{f}: missing (listed in {MANIFEST})")
            if f.stat().st_size != meta["bytes"]:
                raise ModelError(
                    f"{f}: {f.stat().st_size} bytes, the manifest says {meta['bytes']} (truncated?)"
                )
            if sha256_file(f) != meta["sha256"]:
                raise ModelError(f"{f}: SHA-256 differs from the manifest (altered?)")
    return manifest


def load_model(
    model_dir: str | Path, device: str | torch.device = "cpu", verify: bool = True
) -> ScoringModel:
    """The :class:`ScoringModel` of a model directory, in eval mode on ``device``."""
    model_dir = Path(model_dir)
    read_manifest(model_dir, verify)
    arch = json.loads((model_dir / ARCH).read_text())
    model = ScoringModel(**arch, meta_tables=True)  # the loaded tables are taken, not copied
    state = torch.load(model_dir / WEIGHTS, map_location="cpu", weights_only=True, mmap=True)
    model.load_state_dict(state, assign=True)
    return model.to(device).eval()


def load_program(model_dir: str | Path) -> Any:
    """The ``torch.export`` program of a model directory (``.module()`` gives a callable)."""
    model_dir = Path(model_dir)
    read_manifest(model_dir)
    return torch.export.load(str(model_dir / PROGRAM))

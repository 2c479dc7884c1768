"""The input transform as a torch module, so a served model takes raw Criteo numbers.

:class:`RawFeaturizer` applies, in the graph, what ``preprocess`` and
:class:`~dlrm_vrgd.serve.features.FeatureMapper` do to a parsed row (the module docstring of
:mod:`dlrm_vrgd.serve.features`, steps 1-3):

* ``dense_raw`` ``B x 13`` int64, the integer columns as written (a missing value is 0, as
  ``preprocess`` fills it): ``log(clamp(x, floor) - floor + 2)`` in float32;
* ``ids_raw`` ``B x 26`` int64, the categorical hex values as integers (``int("68fd1e64", 16)``;
  a missing value is 0; values must be below 2^63 — Criteo's are 32-bit): the preprocessing's
  table caps (``id % cap``), the frequency-threshold vocabulary (kept ids -> ``1 + rank``, others
  -> row 0), the run's read-time caps, and an id still outside its table hashed into it.

What stays outside the graph is text: splitting a line into fields and reading hex digits
(:func:`parse_raw_fields` does it in Python for a serving stack that has rows as strings).
:class:`RawScoringModel` chains the featurizer and the model: ``forward(dense_raw, ids_raw)``
-> ``B`` probabilities; ``model_raw.pt2`` in a model directory is its ``torch.export``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from dlrm_vrgd.serve.features import FeatureError, FeatureLayout

#: The clip that keeps ``x - floor`` from wrapping (as :mod:`dlrm_vrgd.data.criteo.parse`).
DENSE_MAX = 1 << 62


class RawFeaturizer(nn.Module):
    """Raw integers -> ``(dense B x 13 float32, sparse B x 26 int64 table rows)``."""

    def __init__(self, layout: FeatureLayout, vocab: np.ndarray | None = None) -> None:
        super().__init__()
        if layout.source != "criteo":
            raise FeatureError("the model was trained on synthetic data: it has no raw features")
        self.floor = int(layout.dense_floor)
        n = len(layout.table_rows)

        def buffer(name: str, values: Sequence[int] | None) -> bool:
            if values is None:
                return False
            self.register_buffer(name, torch.tensor(list(values), dtype=torch.int64))
            return True

        self.has_caps = buffer("caps", layout.preprocess_caps)
        self.has_read_caps = buffer("read_caps", layout.read_caps)
        buffer("rows", layout.table_rows)
        self.vocab_sizes: list[int] = []
        if layout.frequency_threshold:
            if vocab is None:
                raise FeatureError(
                    "the model's data was preprocessed with a frequency threshold whose kept ids "
                    "were not saved (an older preprocess): no raw featurizer"
                )
            self.vocab_sizes = [int(c) - 1 for c in layout.data_cardinalities or []]
            if len(self.vocab_sizes) != n or sum(self.vocab_sizes) != len(vocab):
                raise FeatureError("vocab.npy does not match the data's cardinalities")
            self.register_buffer("vocab", torch.as_tensor(np.asarray(vocab, dtype=np.int64)))

    def forward(
        self, dense_raw: torch.Tensor, ids_raw: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = dense_raw.clamp(self.floor, DENSE_MAX) - (self.floor - 2)
        dense = torch.log(x.to(torch.float32))
        ids = ids_raw
        if self.has_caps:
            ids = torch.remainder(ids, self.caps)
        if self.vocab_sizes:
            ids = self.kept_rows(ids)
        if self.has_read_caps:
            ids = torch.remainder(ids, self.read_caps)
        ids = torch.where(ids >= self.rows, torch.remainder(ids, self.rows), ids)
        return dense, ids

    def kept_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Ids kept by the frequency threshold -> ``1 + rank`` among their table's kept ids,
        every other id -> 0 (``searchsorted`` in each table's sorted ``vocab`` slice)."""
        cols, start = [], 0
        for j, size in enumerate(self.vocab_sizes):
            kept = self.vocab[start : start + size]
            start += size
            col = ids[:, j].contiguous()
            pos = torch.searchsorted(kept, col)
            found = kept[pos.clamp(max=size - 1)] == col
            cols.append(torch.where(found & (pos < size), pos + 1, torch.zeros_like(pos)))
        return torch.stack(cols, dim=1)


class RawScoringModel(nn.Module):
    """The featurizer, then the scoring model: raw integers -> ``B`` click probabilities."""

    def __init__(self, featurizer: RawFeaturizer, model: nn.Module) -> None:
        super().__init__()
        self.featurizer = featurizer
        self.model = model

    def forward(self, dense_raw: torch.Tensor, ids_raw: torch.Tensor) -> torch.Tensor:
        dense, sparse = self.featurizer(dense_raw, ids_raw)
        return self.model(dense, sparse)


def parse_raw_fields(
    fields: Sequence[str], num_dense: int = 13, num_sparse: int = 26
) -> tuple[list[int], list[int]]:
    """One unlabeled row's fields (13 integers then 26 hex ids, empty = missing) -> the raw
    integers :class:`RawScoringModel` takes; ``ValueError`` naming the field otherwise."""
    if len(fields) != num_dense + num_sparse:
        raise ValueError(f"expected {num_dense + num_sparse} fields, got {len(fields)}")
    dense, ids = [], []
    for i, text in enumerate(fields[:num_dense]):
        try:
            dense.append(int(text) if text else 0)
        except ValueError:
            raise ValueError(f"field I{i + 1}: not an integer") from None
    for j, text in enumerate(fields[num_dense:]):
        try:
            value = int(text, 16) if text else 0
        except ValueError:
            raise ValueError(f"field C{j + 1}: not a hex id") from None
        if value >= 1 << 63:
            raise ValueError(f"field C{j + 1}: over 2^63")
        ids.append(value)
    return dense, ids

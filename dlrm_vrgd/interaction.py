"""DLRM's dot interaction, its upper triangle gathered by ``index_select``.

torchrec's ``InteractionArch`` takes the pairwise dot products ``Z = X Xᵀ`` of the ``F + 1``
feature vectors of each row (``X``: the dense arch's output and the ``F`` pooled embeddings,
``B x (F+1) x D``) and keeps the upper triangle without the diagonal as ``Z[:, li, lj]``. That
advanced index's backward is a sort-based ``index_put`` (on an H200: 5.6 ms of a 64k micro-batch,
a third of the step's GPU time with its forward). The same entries are ``Z.flatten(1)`` at
``i·(F+1) + j``: an ``index_select``, whose backward is a plain ``index_add`` (0.3 ms). Values and
gradients are the same, bit for bit (each entry is gathered once, so its gradient is one add).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def upper_pairs(n: int) -> Tensor:
    """Flat indices ``i·n + j`` of the pairs ``i < j`` of an ``n x n`` matrix, in the order of
    ``torch.triu_indices(n, n, offset=1)`` (row-major)."""
    rows, cols = torch.triu_indices(n, n, offset=1)
    return rows * n + cols


class DotInteraction(nn.Module):
    """torchrec's ``InteractionArch`` (same inputs, outputs and order): ``forward(dense B x D,
    sparse B x F x D) -> B x (D + F + F·(F−1)/2)``, the dense features then the dot products of
    every pair of the ``F + 1`` vectors."""

    def __init__(self, num_sparse_features: int) -> None:
        super().__init__()
        self.F = num_sparse_features
        self.register_buffer("pairs", upper_pairs(self.F + 1), persistent=False)

    def forward(self, dense_features: Tensor, sparse_features: Tensor) -> Tensor:
        if self.F <= 0:
            return dense_features
        combined = torch.cat((dense_features.unsqueeze(1), sparse_features), dim=1)
        return torch.cat((dense_features, pairwise_dots(combined, self.pairs)), dim=1)


def pairwise_dots(combined: Tensor, pairs: Tensor) -> Tensor:
    """The dot products of the pairs ``pairs`` (flat indices, :func:`upper_pairs`) of the rows
    of each ``combined[b]`` (``B x N x D``): ``B x len(pairs)``."""
    dots = torch.bmm(combined, combined.transpose(1, 2))
    return dots.flatten(1).index_select(1, pairs)

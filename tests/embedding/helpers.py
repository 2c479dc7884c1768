"""Random multi-hot KJT batches that can be cut into micro-batches (bags stay whole)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


@dataclass
class Bags:
    """``ids[f][b]`` / ``weights[f][b]``: the ids (and weights) of bag ``b`` of feature ``f``."""

    keys: list[str]
    ids: list[list[torch.Tensor]]
    weights: list[list[torch.Tensor]] | None

    @property
    def batch(self) -> int:
        return len(self.ids[0])

    def kjt(self, start: int = 0, stop: int | None = None) -> KeyedJaggedTensor:
        stop = self.batch if stop is None else stop
        values, lengths, weights = [], [], []
        for f in range(len(self.keys)):
            for b in range(start, stop):
                values.append(self.ids[f][b])
                lengths.append(len(self.ids[f][b]))
                if self.weights is not None:
                    weights.append(self.weights[f][b])
        return KeyedJaggedTensor.from_lengths_sync(
            keys=self.keys,
            values=torch.cat(values).long(),
            lengths=torch.tensor(lengths, dtype=torch.int64),
            weights=torch.cat(weights) if self.weights is not None else None,
        )


def random_bags(
    rows_per_feature: list[int],
    batch: int,
    max_len: int = 3,
    weighted: bool = False,
    min_len: int = 0,
    skew: float = 1.5,
    seed: int = 0,
) -> Bags:
    """Skewed ids (a power law over each feature's table), bag lengths min_len..max_len (empty
    bags included by default; ``min_len = max_len = 1`` gives one-hot Criteo-like bags)."""
    g = torch.Generator().manual_seed(seed)
    ids, ws = [], []
    for n in rows_per_feature:
        p = 1.0 / torch.arange(1, n + 1, dtype=torch.float64) ** skew
        f_ids, f_ws = [], []
        for _ in range(batch):
            length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
            if length:
                f_ids.append(torch.multinomial(p, length, replacement=True, generator=g))
            else:
                f_ids.append(torch.zeros(0, dtype=torch.int64))
            f_ws.append(torch.rand(length, generator=g) + 0.5)
        ids.append(f_ids)
        ws.append(f_ws)
    return Bags([f"f{i}" for i in range(len(rows_per_feature))], ids, ws if weighted else None)


def reference_row_grads(
    bags: Bags,
    feature_table: list[int],
    tables: list[tuple[int, int]],
    pooling: str,
    upstream: torch.Tensor,
    groups: int,
) -> list[torch.Tensor]:
    """Per-group dense table gradients by autograd through ``F.embedding_bag``: one
    ``groups x rows x dim`` float64 tensor per table. ``upstream`` (B x ΣD) is ∂L/∂pooled and
    group ``g`` is bags ``[g·B/G, (g+1)·B/G)``."""
    per_group = bags.batch // groups
    out = []
    for t, (rows, dim) in enumerate(tables):
        g_t = torch.zeros(groups, rows, dim, dtype=torch.float64)
        for g in range(groups):
            w = torch.zeros(rows, dim, dtype=torch.float64, requires_grad=True)
            col, total = 0, 0
            for f, tf in enumerate(feature_table):
                d = tables[tf][1]
                if tf == t:
                    lo, hi = g * per_group, (g + 1) * per_group
                    idx = [bags.ids[f][b] for b in range(lo, hi)]
                    offsets = torch.tensor([0] + [len(i) for i in idx]).cumsum(0)[:-1]
                    psw = None
                    if bags.weights is not None:
                        psw = torch.cat([bags.weights[f][b] for b in range(lo, hi)]).double()
                    pooled = F.embedding_bag(
                        torch.cat(idx), w, offsets, mode=pooling, per_sample_weights=psw
                    )
                    total = total + (pooled * upstream[lo:hi, col : col + d]).sum()
                col += d
            if isinstance(total, torch.Tensor):
                total.backward()
                g_t[g] = w.grad
        out.append(g_t)
    return out

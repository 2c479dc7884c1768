"""Random multi-hot KJT batches that can be cut into micro-batches (bags stay whole)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
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
    skew: float = 1.5,
    seed: int = 0,
) -> Bags:
    """Skewed ids (a power law over each feature's table), bag lengths 0..max_len (empty bags
    included)."""
    g = torch.Generator().manual_seed(seed)
    ids, ws = [], []
    for n in rows_per_feature:
        p = 1.0 / torch.arange(1, n + 1, dtype=torch.float64) ** skew
        f_ids, f_ws = [], []
        for _ in range(batch):
            length = int(torch.randint(0, max_len + 1, (1,), generator=g))
            if length:
                f_ids.append(torch.multinomial(p, length, replacement=True, generator=g))
            else:
                f_ids.append(torch.zeros(0, dtype=torch.int64))
            f_ws.append(torch.rand(length, generator=g) + 0.5)
        ids.append(f_ids)
        ws.append(f_ws)
    return Bags([f"f{i}" for i in range(len(rows_per_feature))], ids, ws if weighted else None)

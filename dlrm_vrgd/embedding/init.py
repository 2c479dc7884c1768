"""Deterministic initial table weights, the same in every process and backend."""

from __future__ import annotations

import math

import torch


def table_init(seed: int, table: int, rows: int, dim: int) -> torch.Tensor:
    """The initial weights of table ``table``: ``U(−√(1/rows), √(1/rows))`` (torchrec's default
    bounds) drawn from a generator seeded by ``(seed, table)`` alone, so that any process — one
    that owns the whole table or one that owns a shard of it — and either embedding backend
    draws the same values."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + table)
    bound = math.sqrt(1.0 / rows)
    return torch.empty(rows, dim).uniform_(-bound, bound, generator=gen)

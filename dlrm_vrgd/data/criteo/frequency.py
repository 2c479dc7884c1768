"""``--frequency-threshold F``: count each capped id over all inputs, then give the ids seen at
least ``F`` times rows ``1..K`` (in increasing id order) and every rarer id row 0.

Counts are one uint32 per capped table row (clamped at ``F`` before they could wrap). The
parsing threads reduce each block to ``(id, count)`` pairs (a sort, or a bincount for small
tables); the main thread adds them. The sparse day files, written with capped ids in the one
parsing pass, are then rewritten in place through the remap tables (no second parse).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

_REMAP_ROWS = 1 << 18


class FrequencyCounts:
    """Per-table occurrence counts of capped ids, for ``--frequency-threshold``."""

    def __init__(self, caps: np.ndarray, threshold: int) -> None:
        self.caps = [int(c) for c in caps]
        self.threshold = threshold
        self.counts = [np.zeros(c, dtype=np.uint32) for c in self.caps]
        self._since_clamp = 0

    @staticmethod
    def contribution(sparse: np.ndarray, caps: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per table ``(ids, counts)`` of one block (run in the parsing threads: sorts)."""
        out = []
        for j, cap in enumerate(caps):
            col = sparse[:, j]
            if cap <= 4 * len(col):
                c = np.bincount(col, minlength=cap)
                ids = np.flatnonzero(c)
                out.append((ids, c[ids]))
            else:
                out.append(np.unique(col, return_counts=True))
        return out

    def add(self, contribution: list[tuple[np.ndarray, np.ndarray]], rows: int) -> None:
        if self._since_clamp + rows >= 1 << 31:  # uint32 must not wrap: only >= F matters
            for c in self.counts:
                np.minimum(c, self.threshold, out=c)
            self._since_clamp = 0
        self._since_clamp += rows
        for c, (ids, n) in zip(self.counts, contribution, strict=True):
            c[ids] += n.astype(np.uint32)

    def remaps(self) -> list[np.ndarray]:
        """Per table: capped id -> 0 (rare) or 1 + rank among the kept ids."""
        out = []
        for j in range(len(self.counts)):
            keep = self.counts[j] >= self.threshold
            self.counts[j] = np.zeros(0, dtype=np.uint32)  # free as we go
            remap = np.cumsum(keep, dtype=np.int32 if len(keep) < 2**31 else np.int64)
            remap *= keep
            out.append(remap)
        return out


def remap_day(path: Path, remaps: list[np.ndarray]) -> None:
    """Rewrite an N x 26 sparse npy file in place: column ``j`` through ``remaps[j]``."""
    mm = np.load(path, mmap_mode="r+")
    for a in range(0, mm.shape[0], _REMAP_ROWS):
        chunk = np.array(mm[a : a + _REMAP_ROWS])
        for j, remap in enumerate(remaps):
            chunk[:, j] = np.take(remap, chunk[:, j])
        mm[a : a + _REMAP_ROWS] = chunk
    mm.flush()
    del mm

"""Planted-signal synthetic Criteo: rows whose true click probability is known.

Each row has ``num_dense`` non-negative counts (with missing values, stored as ``log1p(count)``
like the Criteo recipes) and one categorical id per table. Ids follow a Zipf-like law per table:
rank ``r`` has probability ``∝ ∫_{r+1}^{r+2} x^{-s} dx`` (exact for the inverse-CDF sampler
below), and ranks are scattered over the id space by a fixed bijection
``id = (a·r + b) mod n``, so frequent ids are not simply 0, 1, 2.

Labels come from a hidden *teacher*, a random DLRM-like click model::

    logit = bias + scale · ( α·Σ_t w_t[id_t]/√T                  first-order id effects
                           + β·Σ_r s_r (‖Σ_i u_ri z_i‖² − d)/√(2dR)  low-rank pairwise terms
                           + γ·v·x̂/√F )                          linear dense effect

with ``z_0 = tanh(W x̂)`` the projected standardized dense features and ``z_t = e_t[id_t]`` teacher
embeddings (``d = teacher_dim``; tables above 65,536 rows share teacher rows by ``id mod 65536``).
``scale`` sets the logit's standard deviation to ``signal_scale`` and ``bias`` sets the mean
click probability to ``click_rate``, both fitted once on a calibration sample; (α, β, γ) =
(0.6, 0.8, 0.4). ``label ~ Bernoulli(σ(logit))``, so the *oracle AUC* — the AUC of the true
probabilities — bounds what any model can reach.

Everything is a pure function of ``(seed, split, chunk index)``: any block of rows can be produced
on its own, in any order, by any process, without holding the data set in memory.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from dlrm_vrgd.config import SyntheticData
from dlrm_vrgd.data.rows import Rows

SPLITS = ("train", "val", "test")
_TEACHER_ROWS_MAX = 1 << 16
_CALIBRATION_ROWS = 65_536


def zipf_ranks(u: np.ndarray, n: np.ndarray, s: float) -> np.ndarray:
    """Inverse-CDF Zipf-like sampler: uniforms ``u`` (``N x T``) to ranks in ``[0, n_t)``.

    Uses the continuous law ``p(x) ∝ x^{-s}`` on ``[1, n+1)``; rank ``= floor(x) - 1``.
    """
    if abs(s - 1.0) < 1e-9:
        x = np.power(n + 1.0, u)
    else:
        a = 1.0 - s
        x = np.power(1.0 + u * (np.power(n + 1.0, a) - 1.0), 1.0 / a)
    return np.minimum(np.floor(x).astype(np.int64) - 1, n - 1).clip(min=0)


def zipf_rank_probability(rank: np.ndarray, n: int, s: float) -> np.ndarray:
    """Exact probability of ``rank`` under :func:`zipf_ranks` (for tests and docs)."""
    rank = np.asarray(rank, dtype=np.float64)
    if abs(s - 1.0) < 1e-9:
        return (np.log(rank + 2) - np.log(rank + 1)) / np.log(n + 1.0)
    a = 1.0 - s
    return (np.power(rank + 2, a) - np.power(rank + 1, a)) / (np.power(n + 1.0, a) - 1.0)


@dataclass(frozen=True)
class _Teacher:
    rank_mul: np.ndarray  # T: a in id = (a r + b) mod n
    rank_add: np.ndarray  # T: b
    dense_mu: np.ndarray  # F
    dense_sigma: np.ndarray  # F
    dense_mean: np.ndarray  # F: standardization of log1p(count)
    dense_std: np.ndarray  # F
    w_proj: np.ndarray  # d x F: dense projection
    v_dense: np.ndarray  # F
    first: list[np.ndarray]  # T x (M_t,)
    emb: list[np.ndarray]  # T x (M_t x d)
    u_pair: np.ndarray  # R x (T+1)
    s_pair: np.ndarray  # R of +-1
    scale: float
    bias: float


class SyntheticCriteo:
    """The generator for one config; :meth:`source` gives a split as a row source."""

    def __init__(self, cfg: SyntheticData) -> None:
        self.cfg = cfg
        self.cardinalities = np.asarray(cfg.cardinalities, dtype=np.int64)

    @property
    def num_tables(self) -> int:
        return len(self.cardinalities)

    @cached_property
    def cache_key(self) -> str:
        """Identifies the rows this generator produces (everything but the cache size)."""
        return self.cfg.model_dump_json(exclude={"cache_mb"})

    def split_rows(self, split: str) -> int:
        return {"train": self.cfg.train_rows, "val": self.cfg.val_rows, "test": self.cfg.test_rows}[
            split
        ]

    def source(self, split: str) -> SyntheticSource:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        return SyntheticSource(self, split)

    # ------------------------------------------------------------------ teacher
    @cached_property
    def teacher(self) -> _Teacher:
        cfg = self.cfg
        rng = np.random.default_rng([cfg.seed, 0x7EAC4E12])
        t, f, d, r = self.num_tables, cfg.num_dense, cfg.teacher_dim, cfg.teacher_rank
        n = self.cardinalities
        rank_mul = np.empty(t, dtype=np.int64)
        for i, ni in enumerate(n):
            a = int(rng.integers(1, max(int(ni), 2)))
            while math.gcd(a, int(ni)) != 1:
                a = a + 1 if a + 1 < ni else 1
            rank_mul[i] = a
        rank_add = rng.integers(0, n)
        dense_mu = rng.uniform(0.0, 4.0, f)
        dense_sigma = rng.uniform(0.5, 1.5, f)
        rows = np.minimum(n, _TEACHER_ROWS_MAX)
        partial = _Teacher(
            rank_mul=rank_mul,
            rank_add=rank_add,
            dense_mu=dense_mu,
            dense_sigma=dense_sigma,
            dense_mean=np.zeros(f),
            dense_std=np.ones(f),
            w_proj=rng.normal(0.0, 1.0 / math.sqrt(f), (d, f)),
            v_dense=rng.normal(0.0, 1.0, f),
            first=[rng.normal(0.0, 1.0, int(m)) for m in rows],
            emb=[rng.normal(0.0, 1.0 / math.sqrt(d), (int(m), d)) for m in rows],
            u_pair=rng.normal(0.0, 1.0, (r, t + 1)) / math.sqrt(t + 1),
            s_pair=np.where(np.arange(r) % 2 == 0, 1.0, -1.0),
            scale=1.0,
            bias=0.0,
        )
        # Calibrate on a sample drawn from its own stream (never one of the splits).
        cal_rng = np.random.default_rng([cfg.seed, 0xCA11B])
        counts, sparse = self._draw_features(partial, cal_rng, _CALIBRATION_ROWS)
        x = np.log1p(counts)
        mean, std = x.mean(axis=0), x.std(axis=0) + 1e-6
        partial = replace(partial, dense_mean=mean, dense_std=std)
        raw = self._raw_logits(partial, x, sparse)
        scale = cfg.signal_scale / (raw.std() + 1e-12)
        z = (raw - raw.mean()) * scale
        lo, hi = -30.0, 30.0
        for _ in range(100):  # bisection: mean sigmoid(z + b) == click_rate
            mid = 0.5 * (lo + hi)
            if _sigmoid(z + mid).mean() < cfg.click_rate:
                lo = mid
            else:
                hi = mid
        bias = 0.5 * (lo + hi) - scale * raw.mean()
        return replace(partial, scale=float(scale), bias=float(bias))

    def _draw_features(
        self, teacher: _Teacher, rng: np.random.Generator, n_rows: int
    ) -> tuple[np.ndarray, np.ndarray]:
        cfg = self.cfg
        n = self.cardinalities
        ranks = zipf_ranks(rng.random((n_rows, self.num_tables)), n, cfg.zipf_exponent)
        sparse = (ranks * teacher.rank_mul + teacher.rank_add) % n
        xi = rng.standard_normal((n_rows, cfg.num_dense))
        counts = np.floor(np.exp(teacher.dense_mu + teacher.dense_sigma * xi))
        counts[rng.random((n_rows, cfg.num_dense)) < cfg.dense_missing_rate] = 0.0
        return counts.astype(np.float32), sparse

    def _raw_logits(self, teacher: _Teacher, x: np.ndarray, sparse: np.ndarray) -> np.ndarray:
        t, d, r = self.num_tables, self.cfg.teacher_dim, self.cfg.teacher_rank
        xs = (x - teacher.dense_mean) / teacher.dense_std
        first = np.zeros(len(x))
        proj = np.tanh(xs @ teacher.w_proj.T)[:, None, :] * teacher.u_pair[:, 0][None, :, None]
        for i in range(t):
            bucket = sparse[:, i] % len(teacher.first[i])
            first += teacher.first[i][bucket]
            proj += teacher.emb[i][bucket][:, None, :] * teacher.u_pair[:, i + 1][None, :, None]
        pair = ((np.square(proj).sum(axis=2) - d) * teacher.s_pair).sum(axis=1)
        pair /= math.sqrt(2 * d * r)
        dense = xs @ teacher.v_dense / math.sqrt(self.cfg.num_dense)
        return 0.6 * first / math.sqrt(t) + 0.8 * pair + 0.4 * dense

    # --------------------------------------------------------------------- rows
    def generate(self, split: str, chunk: int) -> Rows:
        """Rows ``[chunk * chunk_rows, ...)`` of ``split``: a pure function of its arguments."""
        cfg = self.cfg
        total = self.split_rows(split)
        start = chunk * cfg.chunk_rows
        if not 0 <= start < total:
            raise IndexError(f"chunk {chunk} is outside the {split} split ({total} rows)")
        n_rows = min(cfg.chunk_rows, total - start)
        teacher = self.teacher
        rng = np.random.default_rng([cfg.seed, SPLITS.index(split) + 1, chunk])
        counts, sparse = self._draw_features(teacher, rng, n_rows)
        x = np.log1p(counts)
        logits = teacher.scale * self._raw_logits(teacher, x, sparse) + teacher.bias
        probs = _sigmoid(logits)
        labels = (rng.random(n_rows) < probs).astype(np.float32)
        return Rows(
            dense=x.astype(np.float32),
            sparse=sparse,
            labels=labels,
            probs=probs.astype(np.float32),
        )


class _ChunkCache:
    """Generated chunks kept across runs of one process, least recently used evicted first."""

    def __init__(self) -> None:
        self._chunks: OrderedDict[tuple[str, str, int], Rows] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # the input pipeline's threads and evals share it

    def get(self, key: tuple[str, str, int]) -> Rows | None:
        with self._lock:
            rows = self._chunks.get(key)
            if rows is not None:
                self._chunks.move_to_end(key)
            return rows

    def put(self, key: tuple[str, str, int], rows: Rows, budget: int) -> None:
        with self._lock:
            if key in self._chunks:  # another thread made it meanwhile
                self._bytes -= self._chunks[key].nbytes
            self._chunks[key] = rows
            self._bytes += rows.nbytes
            while self._bytes > budget and len(self._chunks) > 1:
                _, old = self._chunks.popitem(last=False)
                self._bytes -= old.nbytes


_SHARED_CHUNKS = _ChunkCache()


class SyntheticSource:
    """One split of a :class:`SyntheticCriteo` as a random-access row source."""

    def __init__(self, gen: SyntheticCriteo, split: str) -> None:
        self.gen = gen
        self.split = split
        self.num_rows = gen.split_rows(split)
        self.block_rows = gen.cfg.chunk_rows
        self.cardinalities = [int(c) for c in gen.cardinalities]
        self.num_dense = gen.cfg.num_dense
        self._cache: tuple[int, Rows] | None = None

    def _chunk(self, c: int) -> Rows:
        cache = self._cache  # one read: another thread may replace it
        if cache is not None and cache[0] == c:
            return cache[1]
        budget = self.gen.cfg.cache_mb << 20
        key = (self.gen.cache_key, self.split, c)
        rows = _SHARED_CHUNKS.get(key) if budget else None
        if rows is None:
            rows = self.gen.generate(self.split, c)
            if budget:
                _SHARED_CHUNKS.put(key, rows, budget)
        self._cache = (c, rows)
        return rows

    def read(self, start: int, stop: int) -> Rows:
        """Rows ``[start, stop)`` of the split."""
        if not 0 <= start <= stop <= self.num_rows:
            raise IndexError(f"rows [{start}, {stop}) outside the {self.split} split")
        size = self.block_rows
        parts = []
        pos = start
        while pos < stop:
            c = pos // size
            lo = pos - c * size
            hi = min(stop - c * size, size)
            parts.append(self._chunk(c).slice(lo, hi))
            pos = c * size + hi
        return Rows.concat(parts)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))

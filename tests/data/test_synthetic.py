from __future__ import annotations

import numpy as np
import pytest
import torch

from dlrm_vrgd.config import SyntheticData
from dlrm_vrgd.data.synthetic import SyntheticCriteo, zipf_rank_probability, zipf_ranks
from dlrm_vrgd.metrics import auc


def make(**kw: object) -> SyntheticCriteo:
    base = dict(
        train_rows=20_000,
        val_rows=40_000,
        test_rows=5_000,
        chunk_rows=4096,
        cardinalities=[1000, 50, 7, 20000],
    )
    base.update(kw)
    return SyntheticCriteo(SyntheticData(**base))  # type: ignore[arg-type]


def test_same_seed_same_rows() -> None:
    a = make(seed=3).source("train").read(1000, 9000)
    b = make(seed=3).source("train").read(1000, 9000)
    for x, y in [
        (a.dense, b.dense),
        (a.sparse, b.sparse),
        (a.labels, b.labels),
        (a.probs, b.probs),
    ]:
        np.testing.assert_array_equal(x, y)


def test_different_seed_or_split_differs() -> None:
    a = make(seed=3).source("train").read(0, 2000)
    assert not np.array_equal(a.sparse, make(seed=4).source("train").read(0, 2000).sparse)
    assert not np.array_equal(a.sparse, make(seed=3).source("val").read(0, 2000).sparse)


def test_reads_are_order_independent() -> None:
    """Any range equals the same rows read in other pieces (rows are a function of position)."""
    src = make().source("train")
    whole = src.read(0, 12_000)
    other = make().source("train")
    parts = [other.read(8000, 12_000), other.read(0, 3000), other.read(3000, 8000)]
    np.testing.assert_array_equal(
        np.concatenate([parts[1].sparse, parts[2].sparse, parts[0].sparse]), whole.sparse
    )
    np.testing.assert_array_equal(
        np.concatenate([parts[1].labels, parts[2].labels, parts[0].labels]), whole.labels
    )


def test_split_sizes_and_bounds() -> None:
    src = make().source("test")
    assert src.num_rows == 5_000
    assert len(src.read(4000, 5000)) == 1000
    with pytest.raises(IndexError):
        src.read(4000, 5001)


def test_shapes_and_types() -> None:
    rows = make().source("val").read(0, 3000)
    assert rows.dense.shape == (3000, 13) and rows.dense.dtype == np.float32
    assert rows.sparse.shape == (3000, 4) and rows.sparse.dtype == np.int64
    assert (rows.sparse >= 0).all() and (rows.sparse < np.array([1000, 50, 7, 20000])).all()
    assert set(np.unique(rows.labels)) <= {0.0, 1.0}
    assert (rows.dense >= 0).all()  # log1p of non-negative counts


def test_label_rate_as_configured() -> None:
    for rate in (0.1, 0.3):
        rows = make(click_rate=rate).source("val").read(0, 40_000)
        assert abs(rows.labels.mean() - rate) < 0.01
        assert abs(rows.probs.mean() - rate) < 0.01


def test_missing_dense_rate_at_least_configured() -> None:
    rows = make(dense_missing_rate=0.3).source("val").read(0, 40_000)
    zero = (rows.dense == 0).mean()
    # missing values are stored as count 0; some present counts are 0 as well
    assert 0.3 <= zero < 0.45


def test_zipf_sampler_matches_its_law() -> None:
    rng = np.random.default_rng(0)
    n, s = 1000, 1.2
    ranks = zipf_ranks(rng.random((400_000, 1)), np.array([n]), s)[:, 0]
    freq = np.bincount(ranks, minlength=n) / len(ranks)
    expected = zipf_rank_probability(np.arange(n), n, s)
    assert expected.sum() == pytest.approx(1.0)
    np.testing.assert_allclose(freq[:10], expected[:10], rtol=0.03)
    # the head is much heavier than the tail, as the exponent says
    assert expected[0] / expected[9] == pytest.approx(
        ((2**-0.2 - 1) / (11**-0.2 - 10**-0.2)), rel=1e-9
    )


def test_id_skew_in_generated_rows() -> None:
    gen = make(zipf_exponent=1.1)
    rows = gen.source("val").read(0, 40_000)
    counts = np.sort(np.bincount(rows.sparse[:, 0], minlength=1000))[::-1] / 40_000
    expected = zipf_rank_probability(np.arange(5), 1000, 1.1)
    np.testing.assert_allclose(counts[:5], expected, rtol=0.08)
    # the most frequent id is not simply id 0: ranks are scattered over the id space
    top_ids = np.argsort(np.bincount(rows.sparse[:, 0], minlength=1000))[::-1][:5]
    assert sorted(top_ids.tolist()) != [0, 1, 2, 3, 4]


def test_oracle_auc_well_above_chance_and_labels_follow_probs() -> None:
    rows = make().source("val").read(0, 40_000)
    probs, labels = torch.from_numpy(rows.probs), torch.from_numpy(rows.labels)
    oracle = auc(probs, labels)
    assert oracle > 0.75
    # shuffled probabilities carry no signal: the labels really come from the teacher
    perm = torch.randperm(len(probs), generator=torch.Generator().manual_seed(0))
    assert abs(auc(probs[perm], labels) - 0.5) < 0.02
    # calibration: the observed click rate in each probability decile matches the mean prob
    order = torch.argsort(probs)
    for chunk in torch.chunk(order, 5):
        assert abs(labels[chunk].mean() - probs[chunk].mean()) < 0.03


def test_signal_scale_sets_oracle_auc() -> None:
    weak = make(signal_scale=0.5).source("val").read(0, 20_000)
    strong = make(signal_scale=2.0).source("val").read(0, 20_000)
    auc_weak = auc(torch.from_numpy(weak.probs), torch.from_numpy(weak.labels))
    auc_strong = auc(torch.from_numpy(strong.probs), torch.from_numpy(strong.labels))
    assert 0.55 < auc_weak < auc_strong - 0.1


def test_shared_chunk_cache_generates_each_chunk_once(monkeypatch) -> None:
    calls: list[tuple[str, int]] = []
    real = SyntheticCriteo.generate

    def counting(self, split, chunk):
        calls.append((split, chunk))
        return real(self, split, chunk)

    monkeypatch.setattr(SyntheticCriteo, "generate", counting)
    first = make(cache_mb=16, seed=11).source("train").read(0, 12_000)
    second = make(cache_mb=16, seed=11).source("train").read(0, 12_000)  # another run, same data
    np.testing.assert_array_equal(first.sparse, second.sparse)
    assert calls == [("train", 0), ("train", 1), ("train", 2)]
    make(cache_mb=16, seed=12).source("train").read(0, 100)  # other data: its own chunks
    assert calls[-1] == ("train", 0) and len(calls) == 4

from __future__ import annotations

import math

import pytest
import torch

from dlrm_vrgd.metrics import EvalAccumulator, auc, calibration, logloss, normalized_entropy


def pairwise_auc(p: list[float], y: list[int]) -> float:
    """AUC by its definition: P(score of a random positive > score of a random negative)."""
    pos = [a for a, b in zip(p, y, strict=True) if b == 1]
    neg = [a for a, b in zip(p, y, strict=True) if b == 0]
    wins = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a in pos for b in neg)
    return wins / (len(pos) * len(neg))


def test_auc_hand_computed() -> None:
    p, y = [0.1, 0.4, 0.35, 0.8, 0.2, 0.9], [0, 0, 1, 1, 0, 1]
    # positives 0.35, 0.8, 0.9 vs negatives 0.1, 0.4, 0.2: 8 of 9 pairs ordered right
    assert auc(torch.tensor(p), torch.tensor(y, dtype=torch.float)) == pytest.approx(8 / 9)
    assert pairwise_auc(p, y) == pytest.approx(8 / 9)


def test_auc_matches_definition_on_random_data() -> None:
    g = torch.Generator().manual_seed(0)
    p = torch.rand(300, generator=g)
    y = (torch.rand(300, generator=g) < p).float()
    assert auc(p, y) == pytest.approx(pairwise_auc(p.tolist(), y.int().tolist()), abs=1e-6)


def test_auc_extremes() -> None:
    y = torch.tensor([0.0, 0.0, 1.0, 1.0])
    assert auc(torch.tensor([0.1, 0.2, 0.8, 0.9]), y) == pytest.approx(1.0)
    assert auc(torch.tensor([0.9, 0.8, 0.2, 0.1]), y) == pytest.approx(0.0)


def test_logloss_ne_calibration_hand_computed() -> None:
    p = torch.tensor([0.8, 0.3])
    y = torch.tensor([1.0, 0.0])
    ll = -(math.log(0.8) + math.log(0.7)) / 2
    assert logloss(p, y) == pytest.approx(ll)
    assert normalized_entropy(p, y) == pytest.approx(ll / math.log(2))
    assert calibration(p, y) == pytest.approx(1.1)


def test_accumulator_reports_oracle_beside_model() -> None:
    acc = EvalAccumulator()
    truth = torch.tensor([0.9, 0.1, 0.6, 0.3])
    y = torch.tensor([1.0, 0.0, 1.0, 0.0])
    acc.update(torch.tensor([0.5, 0.6]), y[:2], truth[:2])
    acc.update(torch.tensor([0.7, 0.1]), y[2:], truth[2:])
    m = acc.compute()
    assert m["rows"] == 4
    assert m["oracle_auc"] == pytest.approx(1.0)
    assert m["auc"] == pytest.approx(pairwise_auc([0.5, 0.6, 0.7, 0.1], [1, 0, 1, 0]))


def test_rank_auc_equals_torchrec_auc_with_ties() -> None:
    from dlrm_vrgd.metrics import rank_auc

    g = torch.Generator().manual_seed(3)
    p = torch.randint(0, 20, (500,), generator=g).float() / 20  # many ties
    y = (torch.rand(500, generator=g) < p).float()
    assert rank_auc(p, y) == pytest.approx(pairwise_auc(p.tolist(), y.int().tolist()), abs=1e-9)
    q = torch.rand(500, generator=g)
    assert rank_auc(q, y) == pytest.approx(auc(q, y), abs=1e-6)
    assert rank_auc(q, torch.zeros(500)) == 0.5

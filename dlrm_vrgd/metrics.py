"""Click-model metrics: pure functions of (predicted probability, label), and an accumulator.

* AUC: torchrec's ``compute_auc`` (area under the ROC curve; 0.5 = no signal).
* logloss: mean binary cross-entropy ``−[y log p + (1−y) log(1−p)]``.
* NE (normalized entropy): logloss divided by the entropy of the base click rate — below 1
  means better than always predicting the average; the usual DLRM figure.
* calibration: ``Σp / Σy`` — 1 means predicted clicks match observed clicks.
"""

from __future__ import annotations

import math

import torch

_EPS = 1e-7


def auc(probs: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve, by torchrec's ``compute_auc`` (by :func:`rank_auc` where
    torchrec cannot be imported, e.g. on a host without FBGEMM)."""
    try:
        from torchrec.metrics.auc import compute_auc
    except ImportError:
        return rank_auc(probs, labels)
    probs = probs.detach().float().reshape(1, -1)
    labels = labels.detach().float().reshape(1, -1)
    return float(compute_auc(1, [probs], [labels], [torch.ones_like(probs)])[0])


def rank_auc(probs: torch.Tensor, labels: torch.Tensor) -> float:
    """AUC as the Mann–Whitney statistic: ``(Σ ranks of positives − P(P+1)/2) / (P·N)``, ties
    sharing their mean rank. 0.5 when a class is missing."""
    p = probs.detach().double().reshape(-1)
    y = labels.detach().reshape(-1) > 0.5
    n_pos = int(y.sum())
    n_neg = y.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return 0.5
    values, inverse, counts = torch.unique(p, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    mean_rank = ends - (counts.double() - 1) / 2  # 1-based mean rank of each distinct value
    rank_sum = float(mean_rank[inverse][y].sum())
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def logloss(probs: torch.Tensor, labels: torch.Tensor) -> float:
    p = probs.double().clamp(_EPS, 1 - _EPS)
    y = labels.double()
    return float(-(y * p.log() + (1 - y) * (1 - p).log()).mean())


def normalized_entropy(probs: torch.Tensor, labels: torch.Tensor) -> float:
    rate = float(labels.double().mean())
    if rate <= 0.0 or rate >= 1.0:
        return float("nan")
    base = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
    return logloss(probs, labels) / base


def calibration(probs: torch.Tensor, labels: torch.Tensor) -> float:
    clicks = float(labels.double().sum())
    return float(probs.double().sum()) / clicks if clicks > 0 else float("nan")


def binary_metrics(probs: torch.Tensor, labels: torch.Tensor, prefix: str = "") -> dict[str, float]:
    return {
        f"{prefix}auc": auc(probs, labels),
        f"{prefix}logloss": logloss(probs, labels),
        f"{prefix}ne": normalized_entropy(probs, labels),
        f"{prefix}calibration": calibration(probs, labels),
    }


class EvalAccumulator:
    """Collects predictions over eval batches; :meth:`compute` gives the model's metrics and,
    when the true click probabilities are known (synthetic data), the oracle's beside them."""

    def __init__(self) -> None:
        self._probs: list[torch.Tensor] = []
        self._labels: list[torch.Tensor] = []
        self._truth: list[torch.Tensor] = []

    def update(
        self, probs: torch.Tensor, labels: torch.Tensor, truth: torch.Tensor | None = None
    ) -> None:
        self._probs.append(probs.detach().float().cpu())
        self._labels.append(labels.detach().float().cpu())
        if truth is not None:
            self._truth.append(truth.detach().float().cpu())

    def compute(self) -> dict[str, float]:
        probs, labels = torch.cat(self._probs), torch.cat(self._labels)
        out = binary_metrics(probs, labels)
        out["rows"] = float(labels.numel())
        if len(self._truth) == len(self._probs) and self._truth:
            oracle = binary_metrics(torch.cat(self._truth), labels, prefix="oracle_")
            out.update(oracle)
        return out

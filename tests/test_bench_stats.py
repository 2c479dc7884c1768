"""bench/common.py's interval for a median ratio: the sign-test order statistics, checked
against binomial tail sums computed by hand, and the ABBA interleaving."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from common import interleaved_times, median_interval, paired_ratios  # noqa: E402


def test_nine_values_give_ranks_two_and_eight() -> None:
    # P(Binom(9, 1/2) <= 1) = 10/512: coverage 1 - 20/512 = 0.9609 >= 0.95, while ranks 3..7
    # would cover only 1 - 2·46/512 = 0.8203
    iv = median_interval([9.0, 1.0, 8.0, 2.0, 7.0, 3.0, 6.0, 4.0, 5.0])
    assert (iv.median, iv.low, iv.high) == (5.0, 2.0, 8.0)
    assert iv.coverage == pytest.approx(1 - 20 / 512)
    assert iv.half_width == pytest.approx(0.6)  # (8 - 5) / 5 on the larger side


def test_thirty_one_values_give_ranks_ten_and_twenty_two() -> None:
    # P(B <= 9) for n = 31: Σ_{i<=9} C(31, i) / 2^31 = 0.01472 (coverage 0.9706); rank 11
    # would leave P(B <= 10) = 0.03543 (coverage 0.929)
    iv = median_interval([float(i) for i in range(1, 32)])
    assert (iv.low, iv.high) == (10.0, 22.0)
    assert iv.coverage == pytest.approx(0.97056, abs=1e-4)


def test_too_few_values_give_the_range_and_say_so() -> None:
    iv = median_interval([1.0, 2.0, 3.0, 4.0, 5.0])
    assert (iv.low, iv.high) == (1.0, 5.0)
    assert iv.coverage == pytest.approx(1 - 2 / 32)  # below 95%: n = 5 cannot do better


def test_variants_alternate_order_and_pair_by_repetition() -> None:
    order: list[str] = []
    clock = {"a": 1.0, "b": 2.0}
    times = interleaved_times(
        {name: (lambda n=name: order.append(n)) for name in ("a", "b")}, reps=4, warmup=0
    )
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert all(len(ts) == 4 for ts in times.values())
    times = {k: [v, v * 2, v * 3] for k, v in clock.items()}
    assert paired_ratios(times, "b", "a").median == 2.0

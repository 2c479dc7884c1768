"""GSNR kernels against hand-computed numbers (DESIGN.md 4.1 / 4.3)."""

from __future__ import annotations

import pytest
import torch

from dlrm_vrgd.optim.gsnr import gsnr_ratio, normalize_clip, raw_gsnr, rowwise_ratio


def stats(groups: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, int]:
    g = torch.stack(groups)
    return g.sum(0), (g * g).sum(0), len(groups)


def raw_of(groups: list[torch.Tensor]) -> torch.Tensor:
    s, q, k = stats(groups)
    r, _ = raw_gsnr((s / k) ** 2, q / k)
    return r


def test_two_scalar_groups() -> None:
    a, b = torch.tensor([3.0, 1.0, -2.0]), torch.tensor([1.0, -0.5, 0.5])
    expected = (a + b) ** 2 / (a - b) ** 2  # (1/2 (a+b))^2 / ((a-b)^2 / 4)
    torch.testing.assert_close(raw_of([a, b]), expected)


def test_one_nonzero_group_gives_one_over_k_minus_one() -> None:
    for k in (2, 3, 8):
        groups = [torch.tensor([0.7, -2.0, 5.0])] + [torch.zeros(3)] * (k - 1)
        torch.testing.assert_close(raw_of(groups), torch.full((3,), 1.0 / (k - 1)))


def test_normalize_then_clip_hand_computed() -> None:
    # three groups per element; raw ratios worked out by hand:
    g1 = torch.tensor([1.0, 1.0, 1.0, 2.0])
    g2 = torch.tensor([1.0, 3.0, -1.0, 2.0])
    g3 = torch.tensor([1.0, 2.0, 0.0, 2.0])
    # element 0 and 3: identical groups -> degenerate (r = 1, left out of the mean)
    # element 1: mean 2, s = 14/3, var = 2/3, r = 4 / (2/3) = 6
    # element 2: mean 0, s = 2/3, var = 2/3, r = 0
    s, q, k = stats([g1, g2, g3])
    ratio, st = gsnr_ratio(s, q, k, gamma=0.1)
    # mean over non-degenerate = (6 + 0) / 2 = 3 -> normalized [., 2, 0, .] -> clip [1, 1, 0.1, 1]
    torch.testing.assert_close(ratio, torch.tensor([1.0, 1.0, 0.1, 1.0]))
    assert st.as_dict() == pytest.approx(
        {"raw_gsnr": 3.0, "ratio": 0.775, "frac_clipped": 0.25, "frac_degenerate": 0.5}
    )


def test_gamma_one_is_all_ones_and_bad_gamma_refused() -> None:
    s, q, k = stats([torch.randn(50), torch.randn(50), torch.randn(50)])
    ratio, st = gsnr_ratio(s, q, k, gamma=1.0)
    assert torch.equal(ratio, torch.ones(50))
    assert float(st.frac_clipped) == 0.0
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="gamma"):
            gsnr_ratio(s, q, k, gamma=bad)


def test_loss_scale_leaves_ratio_unchanged() -> None:
    groups = [torch.randn(200, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    base, _ = gsnr_ratio(*stats(groups), gamma=0.05)
    for c in (1e-4, 3.0, 1e4):
        scaled, _ = gsnr_ratio(*stats([g * c for g in groups]), gamma=0.05)
        torch.testing.assert_close(scaled, base, rtol=1e-5, atol=1e-6)


def test_never_nan_or_inf() -> None:
    z = torch.zeros(10)
    cases = [
        stats([z, z, z]),  # zero gradients
        stats([torch.ones(10)]),  # k = 1
        stats([torch.ones(10)] * 4),  # identical groups
        (torch.full((10,), float("inf")), torch.full((10,), float("inf")), 3),
        (torch.full((10,), float("nan")), torch.ones(10), 3),
        stats([torch.full((10,), 1e30), torch.full((10,), -1e30)]),
        (torch.zeros(0), torch.zeros(0), 3),  # empty tensor
    ]
    for s, q, k in cases:
        ratio, st = gsnr_ratio(s, q, k, gamma=0.1)
        assert torch.isfinite(ratio).all() and ((ratio >= 0.1) & (ratio <= 1)).all()
        assert all(v == v and abs(v) != float("inf") for v in st.as_dict().values())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_grads_accumulate_in_fp32(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    groups32 = [torch.randn(64, generator=gen) * 1e-3 for _ in range(8)]
    groups_lo = [g.to(dtype) for g in groups32]
    # what an optimizer accumulates: fp32 sums of the low-precision gradients
    s = sum(g.float() for g in groups_lo)
    q = sum(g.float() ** 2 for g in groups_lo)
    ratio, _ = gsnr_ratio(s, q, 8, gamma=0.1)
    ref, _ = gsnr_ratio(*stats([g.float() for g in groups_lo]), gamma=0.1)
    assert ratio.dtype == torch.float32 and torch.isfinite(ratio).all()
    torch.testing.assert_close(ratio, ref)


def test_all_degenerate_tensor_is_left_alone() -> None:
    r, degenerate = raw_gsnr(torch.ones(4), torch.ones(4))
    ratio, st = normalize_clip(r, degenerate, 0.1)
    assert torch.equal(ratio, torch.ones(4)) and float(st.frac_degenerate) == 1.0


def test_rowwise_ratio_hand_computed() -> None:
    # 2 rows, D = 2, k = 4 groups
    # row 0 touched by one group only: raw = 1/(k-1) = 1/3
    # row 1 touched by all four with the same gradient: degenerate -> 1
    # row 2: groups (1,0), (1,0), (-1,0), (1,0) -> mean (0.5, 0), s = 1, var = 0.75, r = 1/3
    g_sum = torch.tensor([[2.0, -1.0], [4.0, 4.0], [2.0, 0.0]])
    sq_sum = torch.tensor([5.0, 4 * 2.0, 4.0])
    ratio, st = rowwise_ratio(g_sum, sq_sum, k=4, gamma=0.2)
    # non-degenerate rows 0 and 2 both 1/3 -> normalized to 1
    torch.testing.assert_close(ratio, torch.ones(3))
    assert float(st.raw_mean) == pytest.approx(1 / 3)
    # with a third, noisier row the normalization bites
    g_sum = torch.tensor([[2.0, -1.0], [0.2, 0.0], [2.0, 0.0]])
    sq_sum = torch.tensor([5.0, 4.0, 4.0])  # row 1: mean (0.05, 0), s = 1, r = 0.0025/0.9975
    ratio, _ = rowwise_ratio(g_sum, sq_sum, k=4, gamma=0.2)
    r1 = 0.0025 / 0.9975
    mean = (1 / 3 + r1 + 1 / 3) / 3
    expected = torch.tensor([1 / 3 / mean, r1 / mean, 1 / 3 / mean]).clamp(0.2, 1.0)
    torch.testing.assert_close(ratio, expected)


def test_contiguous_segment_lengths_give_the_scatter_result() -> None:
    gen = torch.Generator().manual_seed(3)
    lengths = torch.tensor([5, 1, 0, 17, 9])
    segments = torch.repeat_interleave(torch.arange(5), lengths)
    r = torch.rand(int(lengths.sum()), generator=gen) * 4
    degenerate = torch.rand(r.shape, generator=gen) < 0.3
    ratio, stats = normalize_clip(r, degenerate, 0.2, segments, 5)
    ratio_l, stats_l = normalize_clip(r, degenerate, 0.2, segments, 5, lengths)
    torch.testing.assert_close(ratio_l, ratio)
    for field in ("raw_mean", "ratio_mean", "frac_clipped", "frac_degenerate"):
        torch.testing.assert_close(getattr(stats_l, field), getattr(stats, field))

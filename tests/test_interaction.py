"""The dot interaction by ``index_select`` equals torchrec's ``InteractionArch`` (the
``Z[:, li, lj]`` form) in values and in gradients, bit for bit, and the click models use it."""

from __future__ import annotations

import pytest
import torch
from torchrec.models.dlrm import InteractionArch

from dlrm_vrgd.config import load_config
from dlrm_vrgd.interaction import DotInteraction, upper_pairs
from dlrm_vrgd.model import build_model


def test_upper_pairs_are_the_triangle_row_major() -> None:
    # a 4 x 4 matrix: (0,1) (0,2) (0,3) (1,2) (1,3) (2,3) -> 1 2 3 6 7 11, by hand
    assert upper_pairs(4).tolist() == [1, 2, 3, 6, 7, 11]


@pytest.mark.parametrize("num_sparse", [1, 3, 26])
def test_values_and_gradients_equal_torchrec(num_sparse: int) -> None:
    g = torch.Generator().manual_seed(num_sparse)
    dense = torch.randn(64, 16, generator=g, dtype=torch.float64)
    sparse = torch.randn(64, num_sparse, 16, generator=g, dtype=torch.float64)
    upstream = torch.randn(64, 16 + num_sparse + num_sparse * (num_sparse - 1) // 2, generator=g)
    outs = []
    for module in (InteractionArch(num_sparse), DotInteraction(num_sparse)):
        d, s = dense.clone().requires_grad_(), sparse.clone().requires_grad_()
        out = module(d, s)
        (out * upstream.double()).sum().backward()
        outs.append((out.detach(), d.grad, s.grad))
    for ours, theirs in zip(outs[1], outs[0], strict=True):
        assert torch.equal(ours, theirs)


def test_click_models_use_it() -> None:
    cfg = load_config(None, ["data.source=synthetic", "data.cardinalities=[5, 7, 9]"])
    model = build_model(cfg, [5, 7, 9], 13, torch.device("cpu"))
    assert isinstance(model.dlrm.inter_arch, DotInteraction)
    assert "pairs" not in model.state_dict()  # not persistent: checkpoints are as before

"""Full (element-wise) Adagrad for the tables: FBGEMM's EXACT_ADAGRAD (``optim.sparse.name:
adagrad``) against a float64 reference written from Adagrad's rule, applied once per global step
to the step's mean row gradient ``ḡ`` (DESIGN.md 4.3's route, as for row-wise Adagrad):

    s += ḡ⊙ḡ   (one sum per weight element, rows x D)
    w -= lr · ḡ / (√s + ε)   (ε outside the square root: FBGEMM's kernel)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from dlrm_vrgd.config import ConfigError
from dlrm_vrgd.embedding.fbgemm import FbgemmEmbeddingBagCollection
from dlrm_vrgd.serve.export import export_model
from dlrm_vrgd.train.loop import Trainer

from ..conftest import tiny_config
from ..embedding.helpers import random_bags, reference_row_grads
from ..serve.test_export import eval_probs, exported_probs, train_and_save
from .test_sparse import deferred_step, upstream_for

LR = 0.2
#: Large enough that where ε sits (outside the root, inside, or dropped) shows in the weights.
EPS = 0.05
#: Mixed dims: tables 0 and 2 (dim 4) share a row space but not consecutive buffer storage (the
#: general replay and the element-index view); CONSECUTIVE's share one (the one-table TBE view).
MIXED = [(50, 4), (30, 8), (7, 4)]
CONSECUTIVE = [(50, 4), (7, 4), (30, 8)]


def make_ebc(
    tables: list[tuple[int, int]], kernel: str = "adagrad"
) -> FbgemmEmbeddingBagCollection:
    torch.manual_seed(0)
    configs = [
        EmbeddingBagConfig(name=f"t{i}", num_embeddings=r, embedding_dim=d, feature_names=[f"f{i}"])
        for i, (r, d) in enumerate(tables)
    ]
    return FbgemmEmbeddingBagCollection(configs, kernel, lr=LR, eps=EPS)


def test_config_accepts_adagrad_on_fbgemm_only() -> None:
    cfg = tiny_config("optim.sparse.name=adagrad")
    assert cfg.optim.sparse.kernel == "adagrad" and not cfg.optim.sparse.gsnr
    with pytest.raises(ConfigError, match="optim.sparse.name"):
        tiny_config("optim.sparse.name=adagrad", "model.embedding_backend=torch")


@pytest.mark.parametrize("tables", [MIXED, CONSECUTIVE], ids=["mixed", "consecutive"])
def test_two_steps_equal_the_float64_reference(tables: list[tuple[int, int]]) -> None:
    ebc = make_ebc(tables)
    w = [t.detach().clone().double() for t in ebc.table_weights()]
    s = [torch.zeros(r, d, dtype=torch.float64) for r, d in tables]
    k = 4
    touched: list[set[int]] = [set() for _ in tables]
    for step in range(2):
        bags = random_bags([r for r, _ in tables], batch=8 * k, seed=11 + step)
        upstream = torch.randn(
            8 * k, sum(d for _, d in tables), generator=torch.Generator().manual_seed(step)
        )
        deferred_step(ebc, bags, upstream, k=k)
        # each group's loss is the mean over its own 8 bags; ḡ is the mean over the k groups
        groups = reference_row_grads(bags, [0, 1, 2], tables, "sum", upstream.double() / 8, k)
        for t in range(len(tables)):
            g = groups[t].mean(0)
            s[t] += g * g
            w[t] -= LR * g / (s[t].sqrt() + EPS)
            for ids in bags.ids[t]:
                touched[t].update(ids.tolist())
    states = ebc.row_states()
    for t, (rows, dim) in enumerate(tables):
        assert states[t].shape == (rows, dim)  # element-wise, not one sum per row
        torch.testing.assert_close(states[t].double(), s[t], rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(ebc.table_weights()[t].double(), w[t], rtol=1e-5, atol=1e-6)
        untouched = sorted(set(range(rows)) - touched[t])
        if rows == 50:
            assert untouched, "every row touched: the check below would be empty"
        assert torch.all(states[t][untouched] == 0)
        # the state really is per element: a touched row's sums differ across its columns
        row = sorted(touched[t])[0]
        assert states[t][row].unique().numel() > 1


def test_adagrad_equals_fbgemm_fused_on_the_global_batch() -> None:
    """Deferred to one step over 8 micro-batches = FBGEMM's own fused backward on the whole
    batch (the kernel's exact arithmetic, not a reference's)."""
    bags = random_bags([r for r, _ in MIXED], batch=64, seed=5)
    upstream = upstream_for(64)
    ours, ref = make_ebc(MIXED), make_ebc(MIXED)
    deferred_step(ours, bags, upstream, k=8)
    ref.capture.remove()
    (ref(bags.kjt()).values() * upstream).sum().div(64).backward()
    for a, b in zip(ours.table_weights(), ref.table_weights(), strict=True):
        torch.testing.assert_close(a, b)
    for a, b in zip(ours.row_states(), ref.row_states(), strict=True):
        assert a.shape == b.shape and a.dim() == 2
        torch.testing.assert_close(a, b)


def test_export_of_an_elementwise_adagrad_checkpoint_scores_as_the_trainer(tmp_path: Path) -> None:
    """Full Adagrad's tables (``adagrad``: rows x dim optimizer state in the checkpoint) export:
    the model needs no optimizer state, and scores as the trainer does."""
    cfg = tiny_config("optim.sparse.name=adagrad")
    trainer = train_and_save(cfg, tmp_path / "run")
    state = torch.load(next((tmp_path / "run").glob("checkpoints/*/rank0.pt")), weights_only=True)
    assert all(s.dim() == 2 for t in state["tables"] for s in t["states"])
    want, batches = eval_probs(trainer)
    export_model(tmp_path / "run", tmp_path / "model")
    torch.testing.assert_close(exported_probs(tmp_path / "model", batches), want)
    fresh, _ = eval_probs(Trainer(cfg))
    assert not torch.allclose(fresh, want)


@pytest.mark.parametrize("tables", [MIXED, CONSECUTIVE], ids=["mixed", "consecutive"])
def test_gsnr_adagrad_scales_the_elementwise_step_by_the_row_ratio(
    tables: list[tuple[int, int]],
) -> None:
    """``gsnr_adagrad`` (placement ``update``): ``s += ḡ⊙ḡ`` unscaled, ``w -= lr·r_row·ḡ/(√s+ε)``;
    the ratios are the optimizer's own (tests/optim/test_sparse.py checks them)."""
    ebc = make_ebc(tables)
    w = [t.detach().clone().double() for t in ebc.table_weights()]
    s = [torch.zeros(r, d, dtype=torch.float64) for r, d in tables]
    k = 4
    for step in range(2):
        bags = random_bags([r for r, _ in tables], batch=8 * k, seed=21 + step)
        upstream = torch.randn(8 * k, 16, generator=torch.Generator().manual_seed(step))
        opt = deferred_step(ebc, bags, upstream, k=k, gsnr=True, gamma=0.25)
        groups = reference_row_grads(bags, [0, 1, 2], tables, "sum", upstream.double() / 8, k)
        for t in range(len(tables)):
            rec = opt.last_rows[0][t]
            assert rec.ratio.min() < 0.99  # some rows really are damped
            g = groups[t].mean(0)
            ratio = torch.ones(tables[t][0], dtype=torch.float64)
            ratio[rec.rows] = rec.ratio.double()
            s[t] += g * g
            w[t] -= LR * ratio[:, None] * g / (s[t].sqrt() + EPS)
    for t in range(len(tables)):
        torch.testing.assert_close(ebc.row_states()[t].double(), s[t], rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(ebc.table_weights()[t].double(), w[t], rtol=1e-5, atol=1e-6)

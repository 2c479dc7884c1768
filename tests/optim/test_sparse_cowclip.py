"""CowClip on the tables (arXiv 2204.06240, Algorithm 1, as its authors' code runs it) against a
reference written here, sample by sample: for a step of G samples with mean loss
L = (1/G) Σ_b ℓ_b, per touched row j,

    ḡ_j = ∂L/∂w_j = (1/G) Σ_b Σ_{occurrences of j in sample b} ∂ℓ_b/∂pooled_b
    cnt_j = number of samples whose bag holds j      (tf.unique_with_counts over the column)
    g_j = ḡ_j + 2λ·w_j                               (Keras l2(λ) in the loss, before the clip)
    t_j = r · cnt_j · max(‖w_j‖, r·√D·ζ)             (clip_id_norm with min_w = r·√D·ζ)
    g_j ← g_j · min(1, t_j / ‖g_j‖)

then the fused kernel (row-wise Adagrad or SGD) on g_j. At r = 0.5 the placement of r matters
(r·max(‖w‖, r√Dζ) is not max(r‖w‖, r√Dζ) where the floor binds), multi-hot bags make cnt_j
(samples) differ from the occurrence count, and G = 8 makes a bound divided by G differ."""

from __future__ import annotations

import math

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from dlrm_vrgd.config import ConfigError
from dlrm_vrgd.embedding.fbgemm import FbgemmEmbeddingBagCollection, TBELookup
from dlrm_vrgd.optim.sparse import CowClip, SparseRowwiseOptimizer
from dlrm_vrgd.train.loop import Trainer

from ..conftest import tiny_config
from ..embedding.helpers import Bags

ROWS, DIM, LR, EPS = 6, 4, 0.2, 1e-8
#: 4 micro-batches of 2 bags (G = 8), ids by hand: row 1 occurs 5 times in 4 samples (twice in
#: one bag), row 5 three times in one sample, rows 2 and 3 in two samples, row 4 in one, row 0
#: never.
MICRO = [
    [[1, 1, 2], [3]],
    [[1], [4, 2]],
    [[], [1, 3]],
    [[5, 5, 5], [1]],
]
SAMPLES_HOLDING = {1: 4, 2: 2, 3: 2, 4: 1, 5: 1}
B = 2
G = B * len(MICRO)
#: Row 1's weights are large (clip inactive), row 2's small and row 3's zero (the floor
#: r·√D·ζ binds): clipped.
WEIGHTS = torch.tensor(
    [
        [0.3, -0.2, 0.1, 0.0],
        [1.0, -1.0, 1.0, 1.0],
        [0.01, 0.0, -0.01, 0.0],
        [0.0, 0.0, 0.0, 0.0],
        [0.2, 0.1, -0.3, 0.2],
        [-0.5, 0.4, 0.0, 0.1],
    ]
)
UPSTREAM = torch.randn(G, DIM, generator=torch.Generator().manual_seed(3))
CLIP = {"clip_ratio": 0.5, "zeta": 0.05, "weight_decay": 0.1}
#: The rows the reference clips at CLIP (checked against it below, so that every case is met).
CLIPPED = {2, 3, 5}


def bags() -> Bags:
    flat = [torch.tensor(ids, dtype=torch.int64) for mb in MICRO for ids in mb]
    return Bags(keys=["f0"], ids=[flat], weights=None)


def make_ebc(kernel: str) -> FbgemmEmbeddingBagCollection:
    cfg = EmbeddingBagConfig(
        name="t0", num_embeddings=ROWS, embedding_dim=DIM, feature_names=["f0"]
    )
    ebc = FbgemmEmbeddingBagCollection([cfg], kernel, lr=LR, eps=EPS)
    with torch.no_grad():
        ebc.table_weights()[0].copy_(WEIGHTS)
    return ebc


def reference(kernel: str, clip_ratio: float, zeta: float, weight_decay: float):
    """The step from the formula, sample by sample: weights, row states, each touched row's
    clipped gradient and its clip factor."""
    mean_grad = torch.zeros(ROWS, DIM, dtype=torch.float64)
    holders: dict[int, set[int]] = {}
    for b, ids in enumerate(ids for mb in MICRO for ids in mb):
        for j in ids:  # ∂(u_b·pooled_b)/∂w_j = u_b, once per occurrence; the loss is a mean
            mean_grad[j] += UPSTREAM[b].double() / G
            holders.setdefault(j, set()).add(b)
    w = WEIGHTS.double().clone()
    state = torch.zeros(ROWS, dtype=torch.float64)
    grads, factors = {}, {}
    for j in sorted(holders):
        cnt = len(holders[j])
        assert cnt == SAMPLES_HOLDING[j]
        g = mean_grad[j] + 2 * weight_decay * w[j]
        floor = clip_ratio * math.sqrt(DIM) * zeta
        t = clip_ratio * cnt * max(float(w[j].norm()), floor)
        factors[j] = min(1.0, t / float(g.norm()))
        grads[j] = g * factors[j]
        if kernel == "rowwise_adagrad":
            state[j] += grads[j].square().mean()
            w[j] -= LR * grads[j] / (state[j].sqrt() + EPS)
        else:
            w[j] -= LR * grads[j]
    return w.float(), state.float(), grads, factors


def cowclip_step(kernel: str, groups_per_call: int, **clip: float) -> tuple:
    ebc = make_ebc(kernel)
    lookup = ebc.lookup
    if groups_per_call > 1:  # the owner of a sharded table: each call holds several ranks' bags
        lookup.capture.remove()
        lookup = TBELookup(ebc.tbe, ["t0"], groups_per_call=groups_per_call)
    opt = SparseRowwiseOptimizer(
        [lookup], lr=LR, cowclip=CowClip(**clip), groups_per_collect=groups_per_call
    )
    opt.record_rows = True
    data = bags()
    per_call = B * groups_per_call
    for start in range(0, G, per_call):
        out = ebc(data.kjt(start, start + per_call)).values()
        # each group's own mean loss over its B rows, as on every rank
        (out * UPSTREAM[start : start + per_call]).sum().div(B).backward()
        opt.collect()
    assert opt.k == len(MICRO)
    opt.step()
    return ebc, opt


@pytest.mark.parametrize("groups_per_call", [1, 2])
@pytest.mark.parametrize("kernel", ["rowwise_adagrad", "sgd"])
def test_cowclip_equals_the_formula(kernel: str, groups_per_call: int) -> None:
    ebc, opt = cowclip_step(kernel, groups_per_call, **CLIP)
    w_ref, state_ref, grads, factors = reference(kernel, **CLIP)
    assert {j for j, f in factors.items() if f < 1} == CLIPPED
    assert factors[1] == 1.0 and factors[3] < 1 and float(WEIGHTS[3].norm()) == 0  # floor binds
    # the kernel's input, row by row: the clipped gradient, hence the clip factor of each row
    (step,) = opt.last_rows[0]
    assert step.rows.tolist() == sorted(factors)
    for j, got in zip(step.rows.tolist(), step.update, strict=True):
        torch.testing.assert_close(got.double(), grads[j], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(ebc.table_weights()[0], w_ref, rtol=1e-5, atol=1e-6)
    if kernel == "rowwise_adagrad":
        torch.testing.assert_close(ebc.row_states()[0].reshape(-1), state_ref, rtol=1e-5, atol=0)
    assert torch.equal(ebc.table_weights()[0][0], WEIGHTS[0])  # untouched row 0
    summary = opt.summary()[0]
    assert summary["touched_rows"] == 5
    assert summary["cowclip_clipped"] == pytest.approx(len(CLIPPED) / 5)
    assert summary["cowclip_factor"] == pytest.approx(sum(factors.values()) / 5, rel=1e-5)


def train_tables(*overrides: str) -> tuple[list[float], list[torch.Tensor], list[torch.Tensor]]:
    trainer = Trainer(tiny_config("run.steps=3", *overrides))
    losses = [trainer.train_step()["loss"] for _ in range(3)]
    lookup = trainer.lookups[0]
    weights = [w.clone() for w in lookup.table_weights()]
    states = [s.clone() for s in lookup.row_states()]
    return losses, weights, states


def test_inactive_clip_without_decay_is_rowwise_adagrad_exactly() -> None:
    plain = train_tables("optim.sparse.name=rowwise_adagrad")
    clip = train_tables(
        "optim.sparse.name=cowclip_rowwise_adagrad",
        "optim.sparse.clip_ratio=1e30",
        "optim.sparse.weight_decay=0",
    )
    assert clip[0] == plain[0]
    for a, b in zip(clip[1] + clip[2], plain[1] + plain[2], strict=True):
        assert torch.equal(a, b)
    # and an active clip does change the tables
    active = train_tables(
        "optim.sparse.name=cowclip_rowwise_adagrad", "optim.sparse.clip_ratio=1e-5"
    )
    assert not all(torch.equal(a, b) for a, b in zip(active[1], plain[1], strict=True))


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("optim.sparse.clip_ratio=.inf", "optim.sparse.clip_ratio"),
        ("optim.sparse.clip_ratio=0", "optim.sparse.clip_ratio"),
        ("optim.sparse.zeta=-1", "optim.sparse.zeta"),
        ("optim.sparse.weight_decay=.nan", "optim.sparse.weight_decay"),
    ],
)
def test_bad_cowclip_fields_are_named(override: str, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        tiny_config("optim.sparse.name=cowclip_sgd", override)


def test_weight_decay_without_cowclip_is_refused() -> None:
    with pytest.raises(ConfigError, match="optim.sparse.*cowclip"):
        tiny_config("optim.sparse.weight_decay=0.1")
    cfg = tiny_config("optim.sparse.name=cowclip_sgd", "optim.sparse.weight_decay=0.1")
    assert cfg.optim.sparse.kernel == "sgd" and cfg.optim.sparse.cowclip
    with pytest.raises(ValueError, match="alternatives"):
        SparseRowwiseOptimizer([], lr=0.1, gsnr=True, cowclip=CowClip())
    with pytest.raises(ValueError, match="clip_ratio"):
        CowClip(clip_ratio=float("inf"))


def test_torch_backend_clips_like_fbgemm() -> None:
    sets = ("optim.sparse.name=cowclip_rowwise_adagrad", "optim.sparse.clip_ratio=1e-4",
            "optim.sparse.weight_decay=0.01")  # fmt: skip
    fb = train_tables(*sets)
    pt = train_tables(*sets, "model.embedding_backend=torch")
    assert pt[0] == pytest.approx(fb[0], rel=1e-5)
    torch.testing.assert_close(torch.cat(pt[1]), torch.cat(fb[1]), rtol=1e-4, atol=1e-6)

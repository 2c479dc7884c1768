"""One training step as the trainer runs it on a GPU, run on the CPU with its syncs counted.

The trainer (``dlrm_vrgd/train/loop.py``) runs, per global step: for each of ``A`` micro-batches
a forward and backward, then ``dense.collect()`` and ``sparse.collect()``; then
``dense.step()``, ``sparse.step()`` and the noise scale's ``update``; and, on the steps whose GSNR
it logs, the record (``dense.gsnr_summary()``, ``sparse.summary()``, the noise scale's rows).
:func:`counted_step` does the same on a small DLRM-like model (bottom MLP, FBGEMM tables, top
MLP) on the route a GPU takes: the groups merged at the step (``accumulate="merge"``), one id per
bag (the caller's word), no host-side replay view (a GPU TBE has none), and counts the
sync-prone ops (:mod:`tests.optim.syncs`) of the collects, of the step and of the record
separately. Forward and backward are not counted (the model's, not the optimizers').
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import dlrm_vrgd.embedding.fbgemm as fbgemm
from dlrm_vrgd.config import DenseOptimConfig
from dlrm_vrgd.data.synthetic import zipf_ranks
from dlrm_vrgd.optim.dense import build_dense_optimizer
from dlrm_vrgd.optim.noise_scale import NoiseScale
from dlrm_vrgd.optim.sparse import GroupRows, SparseRowwiseOptimizer

from .syncs import SyncCounter

ROWS, DIM, MICRO, DENSE_IN = 2_000, 8, 64, 13

#: Plain dense optimizer of each VR one (lars / lamb are their VR classes with γ = 1).
PLAIN_OF = {
    "vrsgd": "sgd",
    "vradam": "adamw",
    "vrlars": "lars",
    "vrlamb": "lamb",
    "vradagrad": "adagrad",
}


@dataclass
class StepCounts:
    """Sync-prone ops of one step: all ``A`` collects, the step, and the logged record."""

    collect: SyncCounter
    step: SyncCounter
    record: SyncCounter

    @property
    def total(self) -> int:
        return self.collect.total + self.step.total + self.record.total

    def describe(self) -> str:
        parts = []
        for name in ("collect", "step", "record"):
            c: SyncCounter = getattr(self, name)
            parts.append(f"{name} {c.total} {dict(c.kinds)}")
        return "; ".join(parts)


class Model(nn.Module):
    """Bottom MLP on the dense features, pooled table rows, top MLP on their concatenation;
    ``layers`` hidden layers in the top MLP (more dense tensors)."""

    def __init__(self, tables: int, layers: int = 1, precision: str = "fp32") -> None:
        super().__init__()
        configs = [
            EmbeddingBagConfig(
                name=f"t{i}", num_embeddings=ROWS, embedding_dim=DIM, feature_names=[f"f{i}"]
            )
            for i in range(tables)
        ]
        self.ebc = fbgemm.FbgemmEmbeddingBagCollection(
            configs, "rowwise_adagrad", lr=0.05, seed=0, precision=precision
        )
        self.ebc.capture.one_hot = True  # the trainer's rows hold one id per table
        self.bottom = nn.Sequential(nn.Linear(DENSE_IN, 16), nn.ReLU(), nn.Linear(16, DIM))
        width = DIM * (tables + 1)
        top: list[nn.Module] = []
        for _ in range(layers):
            top += [nn.Linear(width, 16), nn.ReLU()]
            width = 16
        self.top = nn.Sequential(*top, nn.Linear(width, 1))
        self.keys = [f"f{i}" for i in range(tables)]

    def dense_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.named_parameters() if not n.startswith("ebc.")]

    def loss(self, dense: torch.Tensor, ids: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        b = dense.shape[0]
        kjt = KeyedJaggedTensor(
            keys=self.keys,
            values=ids.t().reshape(-1),
            offsets=torch.arange(b * len(self.keys) + 1),
            stride=b,
        )
        x = torch.cat([self.bottom(dense), self.ebc(kjt).values()], dim=1)
        logit = self.top(x).squeeze(1)
        return nn.functional.binary_cross_entropy_with_logits(logit, label)


def host_tensors(opt: object, ebc: fbgemm.FbgemmEmbeddingBagCollection):  # type: ignore[no-untyped-def]
    """``host`` of :class:`SyncCounter`: the tensors that live on the host on a GPU too — the
    dense optimizer's step counters (``state["step"]``, kept there by ``torch.optim`` and by
    VRAdam / VRLAMB) and FBGEMM's own iteration counter and feature dims (``iter_cpu``,
    ``feature_dims``: the plain step's replay runs a TBE forward, which reads them)."""
    inner = getattr(opt, "optimizer", opt)
    tbes = [lk.tbe for lk in ebc.lookups()]

    def host(t: torch.Tensor) -> bool:
        if any(t is getattr(tbe, n, None) for tbe in tbes for n in ("iter_cpu", "feature_dims")):
            return True
        return any(t is st.get("step") for st in inner.state.values())

    return host


def staging_buffers(sparse_opt: SparseRowwiseOptimizer):  # type: ignore[no-untyped-def]
    """``staging`` of :class:`SyncCounter`: the host buffers into which the merge
    (:class:`~dlrm_vrgd.optim.sparse.accumulate.GroupRows`) stages its groups' pair counts, by
    identity (a buffer it grows into is looked up when read)."""

    def staging(t: torch.Tensor) -> bool:
        return any(
            isinstance(acc, GroupRows) and t is acc.host_counts
            for accs in sparse_opt._acc
            for acc in accs
        )

    return staging


def counted_step(
    micro_batches: int,
    vr: bool,
    *,
    dense: str = "vrsgd",
    tables: int = 4,
    layers: int = 1,
    sparse_gsnr: bool | None = None,
    precision: str = "fp32",
    measure: bool = True,
    monkeypatch=None,  # type: ignore[no-untyped-def]
) -> StepCounts:
    """Sync-prone ops of the second of two steps (the first makes the optimizers' state) of
    ``micro_batches`` micro-batches: ``vr`` the VRGD step (``dense`` and the tables' GSNR,
    realised step ratios measured) or the plain one (``PLAIN_OF[dense]``, the fused kernel).
    ``sparse_gsnr`` overrides the tables' route (default: ``vr``); ``precision``: the tables'
    (``fp16`` rounds its writes stochastically); ``measure``: whether the step is one whose
    figures the trainer records (realised step ratios measured, the record read back)."""
    if monkeypatch is not None:
        monkeypatch.setattr(fbgemm, "space_view", lambda *a, **k: None)  # no host replay view
    torch.manual_seed(0)
    model = Model(tables, layers, precision)
    name = dense if vr else PLAIN_OF[dense]
    cfg = DenseOptimConfig(name=name, lr=0.01, momentum=0.9 if "sgd" in name else 0.0)
    dense_opt = build_dense_optimizer(cfg, model.dense_parameters())
    gsnr = vr if sparse_gsnr is None else sparse_gsnr
    sparse_opt = SparseRowwiseOptimizer(model.ebc.lookups(), lr=0.05, gsnr=gsnr, accumulate="merge")
    noise = NoiseScale(MICRO)
    rng = np.random.default_rng(micro_batches)
    host = host_tensors(dense_opt, model.ebc)
    staging = staging_buffers(sparse_opt)

    def one_step(count: bool) -> StepCounts:
        dense_opt.measure_steps = sparse_opt.measure_steps = measure
        collect = SyncCounter(host, staging)
        for _ in range(micro_batches):
            x = torch.from_numpy(rng.standard_normal((MICRO, DENSE_IN)).astype(np.float32))
            ids = torch.from_numpy(
                zipf_ranks(rng.random((MICRO, tables)), np.full(tables, ROWS), 1.05)
            )
            y = torch.from_numpy((rng.random(MICRO) < 0.3).astype(np.float32))
            model.loss(x, ids, y).backward()
            with collect:
                dense_opt.collect()
                sparse_opt.collect()
        with SyncCounter(host, staging) as step:
            dense_opt.step()
            sparse_opt.step()
            noise.update(dense_opt.noise_pieces(), sparse_opt.noise_pieces())
        with SyncCounter(host, staging) as record:  # the logged step's one read of its figures
            dense_summary = dense_opt.gsnr_summary()
            table_summary = sparse_opt.summary()
            dense_rows, table_rows = noise.dense_rows(), noise.table_rows()
        if count:  # what was read is the step's: sanity of the harness itself
            assert len(table_summary) == tables and all(
                t["touched_rows"] > 0 for t in table_summary
            )
            assert len(dense_rows) == len(model.dense_parameters()) and len(table_rows) == tables
            if vr:
                assert len(dense_summary) == len(model.dense_parameters())
                assert all(0.0 < s["ratio"] <= 1.0 for s in dense_summary)
        return StepCounts(collect, step, record)

    one_step(count=False)
    return one_step(count=True)

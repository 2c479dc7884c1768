"""The same model and the same row-wise updates in plain PyTorch (``model.embedding_backend:
torch``), for hosts without FBGEMM — e.g. a GPU machine that lacks the FBGEMM CUDA build.

Nothing here imports torchrec or FBGEMM. The layers mirror torchrec's DLRM / DLRM_DCN exactly
(``DenseArch`` = Linear+ReLU per layer, dot interaction over the upper triangle without the
diagonal, ``OverArch`` = Linear+ReLU layers then a final Linear; the low-rank cross net
``x_{l+1} = x_0 ⊙ (W_l V_l x_l + b_l) + x_l``), and the embedding update reproduces FBGEMM's
fused kernels on the row gradient ``g`` of each touched row:

* EXACT_ROWWISE_ADAGRAD: ``s_row += mean_d(g_d²)``, ``w_row −= lr · g / (√s_row + ε)``;
* EXACT_SGD: ``w_row −= lr · g``.

The tables of all features share one ``Σrows x D`` buffer (one row space); lookups are captured
by :class:`~dlrm_vrgd.embedding.capture.LookupCapture` exactly as the FBGEMM ones are, so the
sparse optimizer (and its GSNR) runs unchanged. One process only: several processes shard the
tables with torchrec, which needs FBGEMM.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from dlrm_vrgd.config import ModelConfig, TrainConfig
from dlrm_vrgd.data.batch import Batch, feature_names
from dlrm_vrgd.embedding.capture import LookupCapture, LookupLayout
from dlrm_vrgd.embedding.init import table_init
from dlrm_vrgd.embedding.views import RowSpaceView
from dlrm_vrgd.interaction import pairwise_dots, upper_pairs


def mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:], strict=True):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers)


class LowRankCrossNet(nn.Module):
    """``x_{l+1} = x_0 ⊙ (W_l (V_l x_l) + b_l) + x_l`` on ``B x N`` inputs (torchrec's)."""

    def __init__(self, in_features: int, num_layers: int, low_rank: int) -> None:
        super().__init__()
        self.W_kernels = nn.ParameterList(
            [nn.Parameter(nn.init.xavier_normal_(torch.empty(in_features, low_rank)))
             for _ in range(num_layers)]
        )  # fmt: skip
        self.V_kernels = nn.ParameterList(
            [nn.Parameter(nn.init.xavier_normal_(torch.empty(low_rank, in_features)))
             for _ in range(num_layers)]
        )  # fmt: skip
        self.bias = nn.ParameterList(
            [nn.Parameter(torch.zeros(in_features)) for _ in range(num_layers)]
        )

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for w, v, b in zip(self.W_kernels, self.V_kernels, self.bias, strict=True):
            x = x0 * (F.linear(F.linear(x, v), w) + b) + x
        return x


class TableBatchedLookup(nn.Module):
    """Sum-pooled lookup of ``T`` tables of dim ``D`` held in one ``Σrows x D`` buffer, with a
    TBE's calling convention: ``forward(indices, offsets)`` → ``B x T·D``.

    ``indices`` are table-local ids, feature-major (``offsets`` has ``T·B + 1`` entries).
    The weights and the row-wise Adagrad sums are buffers: they get no autograd gradient.
    """

    def __init__(self, rows: list[int], dim: int, optimizer: str, eps: float, seed: int) -> None:
        super().__init__()
        self.dim = dim
        self.optimizer = optimizer
        self.eps = eps
        starts = torch.tensor([0] + rows[:-1]).cumsum(0)
        self.register_buffer("row_offsets", starts, persistent=False)
        weight = torch.cat([table_init(seed, t, n, dim) for t, n in enumerate(rows)])
        self.register_buffer("weight", weight)
        state = torch.zeros(sum(rows) if optimizer == "rowwise_adagrad" else 0)
        self.register_buffer("momentum", state)

    def forward(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        num_features = self.row_offsets.numel()
        bags = (offsets.numel() - 1) // num_features
        lengths = offsets[1:] - offsets[:-1]
        feature = torch.repeat_interleave(
            torch.arange(num_features * bags, device=indices.device) // bags, lengths
        )
        pooled = F.embedding_bag(
            indices + self.row_offsets[feature],
            self.weight,
            offsets[:-1],
            mode="sum",
            per_sample_weights=per_sample_weights,
        )  # (T·B) x D, feature-major
        return pooled.view(num_features, bags, self.dim).transpose(0, 1).reshape(bags, -1)

    @torch.no_grad()
    def update_rows(self, rows: torch.Tensor, grads: torch.Tensor, lr: float) -> None:
        """FBGEMM's fused update of the unique global ``rows`` by their gradients ``grads``."""
        if self.optimizer == "rowwise_adagrad":
            state = self.momentum[rows] + grads.square().mean(dim=1)
            self.momentum[rows] = state
            self.weight[rows] -= (lr / (state.sqrt() + self.eps))[:, None] * grads
        else:
            self.weight[rows] -= lr * grads


class TorchLookup:
    """The :class:`~dlrm_vrgd.optim.sparse.RowwiseLookup` of a :class:`TableBatchedLookup`."""

    def __init__(self, module: TableBatchedLookup, table_names: list[str], rows: list[int]) -> None:
        self.module = module
        self.table_names = table_names
        self.table_rows = rows
        layout = LookupLayout.of(list(range(len(rows))), [module.dim] * len(rows), rows)
        self.capture = LookupCapture(module, layout)

    @property
    def device(self) -> torch.device:
        return self.module.weight.device

    @property
    def kernel(self) -> str:
        return self.module.optimizer

    @property
    def eps(self) -> float:
        return self.module.eps

    def space_views(self) -> list[RowSpaceView]:
        """The one row space: the module's ``Σrows x D`` weights and its row-wise sums."""
        m = self.module
        key = (m.weight.data_ptr(), m.momentum.data_ptr())
        if getattr(self, "_key", None) != key:
            states = m.momentum if m.optimizer == "rowwise_adagrad" else None
            (space,) = self.capture.layout.spaces
            self._views = [RowSpaceView.contiguous(space, m.weight, states)]
            self._key = key
        return self._views

    def apply_rows(
        self, rows: list[torch.Tensor], grads: list[torch.Tensor], lr: float, chunk_rows: int
    ) -> None:
        (space_rows,), (space_grads,) = rows, grads  # one row space: every table has dim D
        self.module.update_rows(space_rows, space_grads, lr)

    def _split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return list(flat.split(self.table_rows)) if flat.numel() else [flat] * len(self.table_rows)

    def table_weights(self) -> list[torch.Tensor]:
        return self._split(self.module.weight)

    def row_states(self) -> list[torch.Tensor]:
        return self._split(self.module.momentum)


class TorchClickModel(nn.Module):
    """The click model without torchrec or FBGEMM (see the module docstring)."""

    def __init__(
        self, cfg: TrainConfig, cardinalities: list[int], num_dense: int, device: torch.device
    ) -> None:
        super().__init__()
        m: ModelConfig = cfg.model
        rows = [int(c) for c in cardinalities]
        num_sparse, dim = len(rows), m.embedding_dim
        sparse = cfg.optim.sparse
        self.tables = TableBatchedLookup(rows, dim, sparse.kernel, sparse.eps, cfg.run.seed)
        names = [f"t_{f}" for f in feature_names(num_sparse)]
        self.lookup = TorchLookup(self.tables, names, rows)
        self.arch = m.arch
        self.dense_arch = mlp([num_dense, *m.dense_arch])
        if m.arch == "dlrm":
            self.register_buffer("pairs", upper_pairs(num_sparse + 1), persistent=False)
            over_in = dim + (num_sparse + 1) * num_sparse // 2
        else:
            self.crossnet = LowRankCrossNet((num_sparse + 1) * dim, m.dcn_num_layers,
                                            m.dcn_low_rank_dim)  # fmt: skip
            over_in = (num_sparse + 1) * dim
        sizes = [over_in, *m.over_arch]
        self.over_arch = nn.Sequential(mlp(sizes[:-1]), nn.Linear(sizes[-2], sizes[-1]))
        self.to(device)

    @property
    def embeddings(self) -> TorchClickModel:
        return self

    def lookups(self) -> list[TorchLookup]:
        return [self.lookup]

    def forward(self, batch: Batch) -> torch.Tensor:
        n, t = batch.sparse.shape
        indices = batch.sparse.t().reshape(-1)
        offsets = torch.arange(n * t + 1, device=indices.device)
        sparse = self.tables(indices, offsets).view(n, t, -1)
        dense = self.dense_arch(batch.dense)
        combined = torch.cat([dense.unsqueeze(1), sparse], dim=1)
        if self.arch == "dlrm":
            features = torch.cat([dense, pairwise_dots(combined, self.pairs)], dim=1)
        else:
            features = self.crossnet(combined.reshape(n, -1))
        return self.over_arch(features).squeeze(-1)

    def loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self(batch)
        return F.binary_cross_entropy_with_logits(logits, batch.labels), logits

    def named_dense_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.named_parameters()

    def dense_parameters(self) -> Iterator[nn.Parameter]:
        return self.parameters()

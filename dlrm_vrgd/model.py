"""The click model: torchrec's DLRM / DLRM_DCN over deferred-update embedding tables."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.models.dlrm import DLRM, DLRM_DCN
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from dlrm_vrgd.config import ModelConfig, SparseOptimConfig
from dlrm_vrgd.data.batch import Batch, feature_names
from dlrm_vrgd.embedding.fbgemm import FbgemmEmbeddingBagCollection


def table_configs(cardinalities: list[int], embedding_dim: int) -> list[EmbeddingBagConfig]:
    names = feature_names(len(cardinalities))
    return [
        EmbeddingBagConfig(
            name=f"t_{name}",
            embedding_dim=embedding_dim,
            num_embeddings=int(n),
            feature_names=[name],
        )
        for name, n in zip(names, cardinalities, strict=True)
    ]


class ClickModel(nn.Module):
    """DLRM (dot interaction) or DLRM_DCN (low-rank cross net) on ``B x F`` dense features and
    ``B x T`` categorical ids; ``forward`` returns ``B`` logits."""

    def __init__(
        self,
        cfg: ModelConfig,
        cardinalities: list[int],
        num_dense: int,
        sparse: SparseOptimConfig,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.keys = feature_names(len(cardinalities))
        tables = table_configs(cardinalities, cfg.embedding_dim)
        embeddings = FbgemmEmbeddingBagCollection(
            tables, optimizer=sparse.kernel, lr=sparse.lr, eps=sparse.eps, device=device
        )
        if cfg.arch == "dlrm":
            self.dlrm: DLRM = DLRM(
                embedding_bag_collection=embeddings,  # type: ignore[arg-type]
                dense_in_features=num_dense,
                dense_arch_layer_sizes=list(cfg.dense_arch),
                over_arch_layer_sizes=list(cfg.over_arch),
                dense_device=torch.device(device),
            )
        else:
            self.dlrm = DLRM_DCN(
                embedding_bag_collection=embeddings,  # type: ignore[arg-type]
                dense_in_features=num_dense,
                dense_arch_layer_sizes=list(cfg.dense_arch),
                over_arch_layer_sizes=list(cfg.over_arch),
                dcn_num_layers=cfg.dcn_num_layers,
                dcn_low_rank_dim=cfg.dcn_low_rank_dim,
                dense_device=torch.device(device),
            )

    @property
    def embeddings(self) -> FbgemmEmbeddingBagCollection:
        return self.dlrm.sparse_arch.embedding_bag_collection  # type: ignore[return-value]

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.dlrm(batch.dense, batch.kjt(self.keys)).squeeze(-1)

    def loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean binary cross-entropy over the batch's rows, and the logits."""
        logits = self(batch)
        return F.binary_cross_entropy_with_logits(logits, batch.labels), logits

    def dense_parameters(self) -> Iterator[nn.Parameter]:
        """Every parameter outside the embedding tables (those train with the sparse optimizer)."""
        sparse = {id(p) for p in self.embeddings.parameters()}
        return (p for p in self.parameters() if id(p) not in sparse)

    def named_dense_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        sparse = {id(p) for p in self.embeddings.parameters()}
        return ((n, p) for n, p in self.named_parameters() if id(p) not in sparse)

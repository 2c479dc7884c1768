"""The click model: torchrec's DLRM / DLRM_DCN over deferred-update embedding tables.

``build_model`` picks the tables by backend and process layout:

* one process, ``fbgemm``: :class:`~dlrm_vrgd.embedding.fbgemm.FbgemmEmbeddingBagCollection`
  (one FBGEMM TBE, updated once per global step);
* several processes, ``fbgemm``: torchrec's ``EmbeddingBagCollection`` on the meta device, to be
  sharded by DistributedModelParallel (:mod:`dlrm_vrgd.train.distributed`);
* ``torch``: the pure-PyTorch model of :mod:`dlrm_vrgd.torch_model` (no torchrec, no FBGEMM),
  for hosts without the FBGEMM build.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from dlrm_vrgd.config import ModelConfig, TrainConfig
from dlrm_vrgd.data.batch import Batch, feature_names
from dlrm_vrgd.interaction import DotInteraction


def table_specs(cardinalities: list[int]) -> list[tuple[str, str, int]]:
    """``(table name, feature name, rows)`` of every table, in feature order."""
    return [(f"t_{f}", f, int(n)) for f, n in zip(feature_names(len(cardinalities)), cardinalities,
                                                   strict=True)]  # fmt: skip


class ClickModel(nn.Module):
    """DLRM (dot interaction) or DLRM_DCN (low-rank cross net) on ``B x F`` dense features and
    ``B x T`` categorical ids; ``forward`` returns ``B`` logits.

    The dense layers are drawn on the CPU, from its generator, and then moved to ``device``: the
    same seed gives the same model on any device (a GPU's generator draws other numbers).
    """

    def __init__(
        self, cfg: ModelConfig, embeddings: nn.Module, num_dense: int, device: torch.device
    ) -> None:
        super().__init__()
        from torchrec.models.dlrm import DLRM, DLRM_DCN

        self.keys = [f for c in embeddings.embedding_bag_configs() for f in c.feature_names]
        common = dict(
            embedding_bag_collection=embeddings,
            dense_in_features=num_dense,
            dense_arch_layer_sizes=list(cfg.dense_arch),
            over_arch_layer_sizes=list(cfg.over_arch),
            dense_device=torch.device("cpu"),
        )
        if cfg.arch == "dlrm":
            self.dlrm: nn.Module = DLRM(**common)
            # the same interaction, its triangle gathered by index_select (dlrm_vrgd/interaction)
            self.dlrm.inter_arch = DotInteraction(len(self.keys))
        else:
            self.dlrm = DLRM_DCN(
                **common, dcn_num_layers=cfg.dcn_num_layers, dcn_low_rank_dim=cfg.dcn_low_rank_dim
            )
        for name, child in self.dlrm.named_children():  # the tables stay where they were built
            if name != "sparse_arch":
                child.to(device)

    @property
    def embeddings(self) -> nn.Module:
        return self.dlrm.sparse_arch.embedding_bag_collection

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.dlrm(batch.dense, batch.kjt(self.keys)).squeeze(-1)

    def loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean binary cross-entropy over the batch's rows, and the logits."""
        logits = self(batch)
        return F.binary_cross_entropy_with_logits(logits, batch.labels), logits

    def named_dense_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Every parameter outside the embedding tables (those train with the sparse optimizer)."""
        return ((n, p) for n, p in self.named_parameters() if not n.startswith("dlrm.sparse_arch."))

    def dense_parameters(self) -> Iterator[nn.Parameter]:
        return (p for _, p in self.named_dense_parameters())


def build_model(
    cfg: TrainConfig,
    cardinalities: list[int],
    num_dense: int,
    device: torch.device,
    for_sharding: bool = False,
) -> nn.Module:
    """The model of ``cfg`` (see the module docstring for which tables it gets)."""
    if cfg.model.embedding_backend == "torch":
        if for_sharding:
            raise ValueError(
                "model.embedding_backend: torch runs on one process; several processes shard "
                "the tables with torchrec, which needs the fbgemm backend"
            )
        from dlrm_vrgd.torch_model import TorchClickModel

        return TorchClickModel(cfg, cardinalities, num_dense, device)
    from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig

    dim = cfg.model.embedding_dim
    data_type = DataType.FP16 if cfg.model.embedding_precision == "fp16" else DataType.FP32
    tables = [
        EmbeddingBagConfig(
            name=t, embedding_dim=dim, num_embeddings=n, feature_names=[f], data_type=data_type
        )
        for t, f, n in table_specs(cardinalities)
    ]
    if for_sharding:
        from torchrec.modules.embedding_modules import EmbeddingBagCollection

        embeddings: nn.Module = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    else:
        from dlrm_vrgd.embedding.fbgemm import FbgemmEmbeddingBagCollection

        sparse = cfg.optim.sparse
        embeddings = FbgemmEmbeddingBagCollection(
            tables,
            sparse.kernel,
            lr=sparse.lr,
            eps=sparse.eps,
            device=device,
            seed=cfg.run.seed,
            precision=cfg.model.embedding_precision,
        )
    return ClickModel(cfg.model, embeddings, num_dense, device)

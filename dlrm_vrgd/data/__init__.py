"""Data sources: planted-signal synthetic Criteo and preprocessed Criteo day files."""

from __future__ import annotations

from dataclasses import dataclass

from dlrm_vrgd.config import DataConfig, SyntheticData
from dlrm_vrgd.data.rows import Rows, RowSource

__all__ = ["DataSplits", "Rows", "RowSource", "build_splits"]


@dataclass(frozen=True)
class DataSplits:
    train: RowSource
    val: RowSource
    test: RowSource

    @property
    def cardinalities(self) -> list[int]:
        return list(self.train.cardinalities)

    @property
    def num_dense(self) -> int:
        return self.train.num_dense


def build_splits(cfg: DataConfig) -> DataSplits:
    """The train / val / test sources named by the data config."""
    if isinstance(cfg, SyntheticData):
        from dlrm_vrgd.data.synthetic import SyntheticCriteo

        gen = SyntheticCriteo(cfg)
        return DataSplits(gen.source("train"), gen.source("val"), gen.source("test"))
    from dlrm_vrgd.data.criteo.source import criteo_splits  # issue: real Criteo data

    return criteo_splits(cfg)

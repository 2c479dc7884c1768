"""Data sources: planted-signal synthetic Criteo and preprocessed Criteo day files."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dlrm_vrgd.config import DataConfig, SyntheticData
from dlrm_vrgd.data.rows import Rows, RowSource

if TYPE_CHECKING:
    from dlrm_vrgd.data.multihot import BagLayout

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

    @property
    def bags(self) -> BagLayout | None:
        """The fixed bag sizes of multi-hot rows (None: one id a table)."""
        from dlrm_vrgd.data.multihot import bags_of

        return bags_of(self.train)


def build_splits(cfg: DataConfig) -> DataSplits:
    """The train / val / test sources named by the data config."""
    if isinstance(cfg, SyntheticData):
        from dlrm_vrgd.data.synthetic import SyntheticCriteo

        gen = SyntheticCriteo(cfg)
        sources = [gen.source(split) for split in ("train", "val", "test")]
        if cfg.multi_hot_sizes is not None:  # MLPerf's synthesis over the synthetic ids
            from dlrm_vrgd.data.multihot import MultiHotSource, MultiHotTables

            tables = MultiHotTables(cfg.cardinalities, cfg.multi_hot_sizes)
            sources = [MultiHotSource(s, tables) for s in sources]
        return DataSplits(*sources)
    from dlrm_vrgd.data.criteo.source import criteo_splits  # issue: real Criteo data

    return criteo_splits(cfg)

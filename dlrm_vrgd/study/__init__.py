"""Batch-size studies: does VRGD hold AUC as the global batch grows?"""

from dlrm_vrgd.study.config import Cell, StudyConfig, StudyOptimizer, load_study
from dlrm_vrgd.study.run import rewrite_report, run_study

__all__ = ["Cell", "StudyConfig", "StudyOptimizer", "load_study", "rewrite_report", "run_study"]

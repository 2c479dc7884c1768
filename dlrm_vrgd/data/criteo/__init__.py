"""Real Criteo: raw day files to memory-mapped arrays (``dlrm-vrgd preprocess``), and those
arrays as training input.

- :mod:`~dlrm_vrgd.data.criteo.format`: the raw TSV layout, opening inputs (gzip, confined);
- :mod:`~dlrm_vrgd.data.criteo.validate`: which values are malformed, and why;
- :mod:`~dlrm_vrgd.data.criteo.parse`: a block of lines to dense / sparse / label arrays;
- :mod:`~dlrm_vrgd.data.criteo.frequency`: rare-id counting and remapping;
- :mod:`~dlrm_vrgd.data.criteo.output`: the day files and their manifest;
- :mod:`~dlrm_vrgd.data.criteo.preprocess`: the conversion end to end;
- :mod:`~dlrm_vrgd.data.criteo.source`: preprocessed days as train / val / test sources.
"""

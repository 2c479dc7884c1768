"""A trained model outside the trainer: export from a checkpoint, load, and score.

* :mod:`~dlrm_vrgd.serve.model`: the scoring module (plain PyTorch: no torchrec, no FBGEMM);
* :mod:`~dlrm_vrgd.serve.features`: the mapping of a raw Criteo row to the model's inputs;
* :mod:`~dlrm_vrgd.serve.export`: ``dlrm-vrgd export`` (checkpoint -> model directory);
* :mod:`~dlrm_vrgd.serve.score`: ``dlrm-vrgd score`` (raw or preprocessed rows -> predictions).
"""

"""One seed, one model: the dense layers are drawn on the CPU from its generator and then moved
to the run's device, so a GPU run starts from the weights a CPU run starts from (a GPU's own
generator draws other numbers). Checked without a GPU: a model built for the ``meta`` device
draws every random initial value on the CPU — the same values, in the same order, as a model
built for the CPU — and only then holds its dense layers on ``meta``."""

from __future__ import annotations

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from dlrm_vrgd.config import load_config
from dlrm_vrgd.embedding.fbgemm import FbgemmEmbeddingBagCollection
from dlrm_vrgd.model import ClickModel
from dlrm_vrgd.torch_model import TorchClickModel

CARDS = [5, 7, 9]


class Draws:
    """Records every in-place random draw (``uniform_``/``normal_``): device and values."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.devices: list[str] = []
        self.values: list[torch.Tensor] = []
        for name in ("uniform_", "normal_"):
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._spy(original))

    def _spy(self, original):
        def spy(tensor, *args, **kwargs):
            out = original(tensor, *args, **kwargs)
            self.devices.append(tensor.device.type)
            if tensor.device.type == "cpu":
                self.values.append(tensor.detach().clone())
            return out

        return spy


def build(arch: str, backend: str, device: str, monkeypatch) -> tuple[torch.nn.Module, Draws]:
    cfg = load_config(
        None,
        [
            "data.source=synthetic",
            f"data.cardinalities={CARDS}",
            f"model.arch={arch}",
            f"model.embedding_backend={backend}",
        ],
    )
    draws = Draws(monkeypatch)
    torch.manual_seed(3)  # as the trainer seeds run.seed before building
    if backend == "torch":
        model: torch.nn.Module = TorchClickModel(cfg, CARDS, 13, torch.device(device))
    else:
        tables = [
            EmbeddingBagConfig(
                name=f"t{i}", num_embeddings=n, embedding_dim=16, feature_names=[f"f{i}"]
            )
            for i, n in enumerate(CARDS)
        ]
        ebc = FbgemmEmbeddingBagCollection(tables, seed=0)  # its tables: table_init, on the CPU
        model = ClickModel(cfg.model, ebc, 13, torch.device(device))
    monkeypatch.undo()
    return model, draws


@pytest.mark.parametrize(
    ("arch", "backend"), [("dlrm", "fbgemm"), ("dlrm_dcn", "fbgemm"), ("dlrm", "torch")]
)
def test_a_model_for_another_device_is_drawn_on_the_cpu(arch, backend, monkeypatch) -> None:
    cpu_model, cpu_draws = build(arch, backend, "cpu", monkeypatch)
    meta_model, meta_draws = build(arch, backend, "meta", monkeypatch)
    assert meta_draws.devices and set(meta_draws.devices) == {"cpu"}  # nothing drawn on meta
    assert len(meta_draws.values) == len(cpu_draws.values)
    for a, b in zip(meta_draws.values, cpu_draws.values, strict=True):
        assert torch.equal(a, b)  # the same numbers: the same model once moved
    dense = [p for n, p in meta_model.named_parameters() if "sparse_arch" not in n]
    assert dense and all(p.device.type == "meta" for p in dense)
    assert any(p.device.type == "cpu" for p in cpu_model.parameters())

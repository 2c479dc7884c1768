"""Float16 tables (``model.embedding_precision: fp16``): FBGEMM stores the weights in float16,
the lookups and every GSNR sum stay float32, and the GSNR step's writes are rounded
stochastically — unbiased, so a step below half an fp16 ulp moves a weight on average instead
of never — with draws that are a fixed function of the seed, the step and the element, so a
resumed run writes what the uninterrupted one did."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dlrm_vrgd.config import ConfigError
from dlrm_vrgd.embedding.fbgemm import FbgemmEmbeddingBagCollection
from dlrm_vrgd.embedding.views import stochastic_round
from dlrm_vrgd.optim.sparse import SparseRowwiseOptimizer
from dlrm_vrgd.train.run import Callback, train

from ..conftest import tiny_config


def test_stochastic_rounding_is_unbiased_bracketing_and_repeatable() -> None:
    x = torch.full((200_000,), 1.0 + 2.0**-12)  # a quarter of the way from 1 to 1 + 2^-10
    keys = torch.arange(x.numel())
    out = stochastic_round(x, torch.float16, keys, salt=7)
    assert set(out.float().unique().tolist()) == {1.0, 1.0 + 2.0**-10}  # its two neighbours
    assert float(out.float().mean()) == pytest.approx(float(x[0]), abs=2e-6)  # unbiased
    assert (out == 1.0 + 2.0**-10).float().mean().item() == pytest.approx(0.25, abs=0.005)
    assert torch.equal(out, stochastic_round(x, torch.float16, keys, salt=7))  # a fixed draw
    assert not torch.equal(out, stochastic_round(x, torch.float16, keys, salt=8))
    exact = torch.tensor([0.5, -2.0, 0.0, float("inf"), float("nan")])
    back = stochastic_round(exact, torch.float16, torch.arange(5), salt=1).float()
    assert back[:4].tolist() == [0.5, -2.0, 0.0, float("inf")] and back[4].isnan()
    assert stochastic_round(x, torch.float32, keys, 0) is x


def test_gsnr_step_on_fp16_tables_moves_small_steps_on_average() -> None:
    """A GSNR row step of lr·r·ḡ/√s far below half an fp16 ulp of the weights: every row would
    keep its weights under round-to-nearest; here the mean move over many rows is the step."""
    rows, dim, lr = 4096, 8, 1e-4
    cfg = EmbeddingBagConfig(name="t", num_embeddings=rows, embedding_dim=dim, feature_names=["f"])
    ebc = FbgemmEmbeddingBagCollection([cfg], "rowwise_adagrad", lr=lr, seed=0, precision="fp16")
    with torch.no_grad():
        ebc.table_weights()[0].fill_(1.0)  # ulp 2^-10: half an ulp is 4.9e-4, the step 1e-4·√D
    opt = SparseRowwiseOptimizer(ebc.lookups(), lr=lr, gsnr=True, gamma=0.5)
    ids = torch.arange(rows)
    kjt = KeyedJaggedTensor(keys=["f"], values=ids, offsets=torch.arange(rows + 1), stride=rows)
    for _ in range(2):  # two groups with the same gradient: every row's ratio is 1
        (ebc(kjt).values() * 1.0).sum().backward()
        opt.collect()
    opt.step()
    w = ebc.table_weights()[0].float()
    assert ebc.table_weights()[0].dtype == torch.float16
    # first update of row-wise Adagrad: each element moves by -lr·g/√mean(g²) = -lr
    assert float(w.mean()) == pytest.approx(1.0 - lr, abs=2e-5)
    assert set(w.unique().tolist()) == {1.0 - 2.0**-11, 1.0}  # the neighbours, no other value


def test_fp16_tables_need_the_fbgemm_backend() -> None:
    with pytest.raises(ConfigError, match="embedding_precision"):
        tiny_config("model.embedding_precision=fp16", "model.embedding_backend=torch")


class StopAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step(self, record: dict) -> None:
        if record["step"] == self.step:
            raise RuntimeError("stop")


@pytest.mark.parametrize("sparse", ["gsnr_rowwise_adagrad", "rowwise_adagrad"])
def test_fp16_run_resumes_bit_for_bit_and_trains_like_fp32(tmp_path: Path, sparse: str) -> None:
    args = ["run.steps=6", "run.checkpoint_every=3", f"optim.sparse.name={sparse}"]
    fp16 = tiny_config(*args, "model.embedding_precision=fp16")
    whole = train(fp16, tmp_path / "whole")
    with pytest.raises(RuntimeError, match="stop"):
        train(fp16, tmp_path / "cut", callbacks=[StopAt(5)])
    resumed = train(fp16, tmp_path / "cut", resume=True)
    assert resumed.losses == whole.losses[3:]  # steps 4..6, bit for bit
    assert resumed.test == whole.test
    fp32 = train(tiny_config(*args), tmp_path / "fp32")
    assert abs(whole.test["auc"] - fp32.test["auc"]) < 0.01
    tables = json.loads((tmp_path / "whole" / "config.json").read_text())["model"]
    assert tables["embedding_precision"] == "fp16"


def _two_rank_fp16(rank: int, world: int, out: str) -> dict:
    from dlrm_vrgd.train.distributed import DistEnv

    cfg = tiny_config(
        "run.steps=3",
        "run.nproc_per_node=2",
        "model.embedding_precision=fp16",
        "optim.sparse.name=gsnr_rowwise_adagrad",
    )
    from dlrm_vrgd.train.loop import Trainer

    trainer = Trainer(cfg, env=DistEnv(rank=rank, world_size=world, local_rank=rank))
    dtypes = sorted({str(w.dtype) for lk in trainer.lookups for w in lk.table_weights()})
    losses = [trainer.train_step()["loss"] for _ in range(3)]
    return {"dtypes": dtypes, "losses": losses}


def test_fp16_tables_shard_over_two_ranks(tmp_path: Path) -> None:
    """torchrec builds float16 shards from the tables' data_type; both ranks train them."""
    from ..dist_utils import run_ranks

    first, second = run_ranks(_two_rank_fp16, 2, tmp_path / "ranks", str(tmp_path / "run"))
    assert first["dtypes"] == second["dtypes"] == ["torch.float16"]
    assert first["losses"] == second["losses"]  # the mean over every rank's groups
    assert all(0.0 < loss < 1.0 for loss in first["losses"])


def test_an_fp16_run_exports_float32_tables_of_the_same_values(tmp_path: Path) -> None:
    from dlrm_vrgd import checkpoint as ckpt
    from dlrm_vrgd.serve.export import export_model
    from dlrm_vrgd.serve.model import load_model

    train(tiny_config("run.steps=2", "run.checkpoint_every=2", "model.embedding_precision=fp16"),
          tmp_path / "run")  # fmt: skip
    export_model(tmp_path / "run", tmp_path / "model", program=False)
    model = load_model(tmp_path / "model")
    state = ckpt.load_rank_state(ckpt.latest_checkpoint(tmp_path / "run"), 0)
    (tables,) = state["tables"]
    assert {w.dtype for w in tables["weights"]} == {torch.float16}
    assert model.weight.dtype == torch.float32
    assert torch.equal(model.weight, torch.cat(tables["weights"]).float())

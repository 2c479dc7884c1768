"""The pure-PyTorch backend agrees with the torchrec + FBGEMM one and needs neither."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from dlrm_vrgd.embedding.fbgemm import FbgemmEmbeddingBagCollection
from dlrm_vrgd.torch_model import TableBatchedLookup
from dlrm_vrgd.train.loop import Trainer

from .conftest import tiny_config
from .embedding.helpers import random_bags

OPTIM = {
    "dense": {"name": "vrlamb", "lr": 0.01, "gamma": 0.3},
    "sparse": {"name": "gsnr_rowwise_adagrad", "lr": 0.1, "gamma": 0.3},
}


@pytest.mark.parametrize("arch", ["dlrm", "dlrm_dcn"])
def test_backends_train_alike(arch: str) -> None:
    fb = Trainer(tiny_config(model={"arch": arch}, optim=OPTIM))
    pt = Trainer(tiny_config(model={"arch": arch, "embedding_backend": "torch"}, optim=OPTIM))
    a_params = list(fb.model.named_dense_parameters())
    b_params = list(pt.model.named_dense_parameters())
    assert [p.shape for _, p in a_params] == [p.shape for _, p in b_params]
    with torch.no_grad():  # same starting point (the tables already share table_init)
        for (_, a), (_, b) in zip(a_params, b_params, strict=True):
            b.copy_(a)
    for a, b in zip(fb.lookups[0].table_weights(), pt.lookups[0].table_weights(), strict=True):
        assert torch.equal(a, b)
    for _ in range(3):
        ra, rb = fb.train_step(), pt.train_step()
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5)
        assert rb["gsnr_ratio"] == pytest.approx(ra["gsnr_ratio"], rel=1e-4)
    for (name, a), (_, b) in zip(a_params, b_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)
    for a, b in zip(fb.lookups[0].table_weights(), pt.lookups[0].table_weights(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    for a, b in zip(fb.lookups[0].row_states(), pt.lookups[0].row_states(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-9)
    ev_a, ev_b = fb.evaluate(fb.splits.val), pt.evaluate(pt.splits.val)
    assert ev_b["auc"] == pytest.approx(ev_a["auc"], abs=1e-5)


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "sgd"])
def test_row_update_is_fbgemms_fused_kernel(optimizer: str) -> None:
    """Same rows, same gradients: TableBatchedLookup.update_rows == the TBE's fused backward."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    rows = [30, 12, 7]
    tables = [
        EmbeddingBagConfig(name=f"t{i}", num_embeddings=n, embedding_dim=4, feature_names=[f"f{i}"])
        for i, n in enumerate(rows)
    ]
    fb = FbgemmEmbeddingBagCollection(tables, optimizer, lr=0.3, seed=5)
    fb.capture.remove()
    pt = TableBatchedLookup(rows, 4, optimizer, eps=1e-8, seed=5)
    bags = random_bags(rows, batch=16, seed=2)
    kjt = bags.kjt()
    upstream = torch.randn(16, 12)
    for _ in range(2):
        out_fb = fb(kjt).values()
        out_pt = pt(kjt.values(), kjt.offsets())
        torch.testing.assert_close(out_pt, out_fb)
        (out_fb * upstream).sum().backward()  # FBGEMM's fused update
        leaf = out_pt.detach().requires_grad_()
        (leaf * upstream).sum().backward()
        grads = torch.zeros_like(pt.weight)  # the same row gradients, by hand
        offsets = kjt.offsets()
        for f in range(3):
            for b in range(16):
                for j in range(int(offsets[f * 16 + b]), int(offsets[f * 16 + b + 1])):
                    row = int(pt.row_offsets[f]) + int(kjt.values()[j])
                    grads[row] += leaf.grad[b, 4 * f : 4 * f + 4]
        touched = grads.abs().sum(1).nonzero().squeeze(1)
        pt.update_rows(touched, grads[touched], lr=0.3)
    torch.testing.assert_close(pt.weight, torch.cat(fb.table_weights()))
    if optimizer == "rowwise_adagrad":
        torch.testing.assert_close(pt.momentum, torch.cat(fb.row_states()))


def test_torch_backend_needs_neither_torchrec_nor_fbgemm(tmp_path) -> None:
    script = textwrap.dedent(
        """
        import importlib.abc, sys
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torchrec", "fbgemm_gpu"):
                    raise ImportError(f"{name} is not installed on this host")
        sys.meta_path.insert(0, Block())
        sys.path.insert(0, %r)
        from tests.conftest import tiny_config
        from dlrm_vrgd.train.run import train
        result = train(tiny_config("model.embedding_backend=torch",
                                   "optim.sparse.name=gsnr_rowwise_adagrad"), %r)
        assert not any(m.split(".")[0] in ("torchrec", "fbgemm_gpu") for m in sys.modules)
        print("AUC", result.test["auc"], result.test["oracle_auc"])
        """
    ) % (str(__import__("pathlib").Path(__file__).resolve().parent.parent), str(tmp_path / "run"))
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("AUC 0.")
    assert (tmp_path / "run" / "result.json").exists()

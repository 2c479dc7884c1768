"""The sparse step as it runs on a GPU, run here on the CPU and counted with ``torch.profiler``
(DESIGN.md 7): the groups merged at the step (``accumulate="merge"``), the caller's word that
every bag holds one id, and no host-side replay view (a GPU TBE has none). On that route a
collect makes no sync-prone op of any kind :mod:`tests.optim.syncs` counts (scalar reads,
``tolist``, host-made device tensors, data-sized ops such as ``unique`` or boolean-mask
indexing; its one read, of the pair count the collect before staged on the host, is the
counter's narrow exception for staging buffers), a GSNR step two a row space (the last group's
staged pair count and the ``unique`` that sizes the step's merged rows), and their op counts do
not grow with the number of tables. The whole trainer step is counted in ``test_step_syncs.py``.

A TBE on the GPU keeps its tables in ``weights_dev``/``momentum1_dev``; the views address them
there exactly as on the host (a stand-in TBE with ``DEVICE`` placements, below).
"""

from __future__ import annotations

import collections
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
from torch.profiler import ProfilerActivity, profile
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import dlrm_vrgd.embedding.fbgemm as fbgemm
from dlrm_vrgd.data.synthetic import zipf_ranks
from dlrm_vrgd.embedding.capture import LookupLayout
from dlrm_vrgd.optim.sparse import SparseRowwiseOptimizer

from .step_route import staging_buffers
from .syncs import SyncCounter

ROWS, DIM, BATCH, K = 2_000, 8, 512, 4
READ_BACKS = ("aten::nonzero", "aten::item", "aten::_local_scalar_dense")


def counted(fn, syncs: SyncCounter | None = None) -> collections.Counter:
    """The aten ops ``fn()`` ran, by name (its sync-prone ops into ``syncs``, if given)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        if syncs is None:
            fn()
        else:
            with syncs:
                fn()
    return collections.Counter(e.name for e in prof.events() if e.name.startswith("aten::"))


def device_route(tables: int, monkeypatch, **opt_kw) -> tuple[collections.Counter, ...]:
    """Op counts of one collect (the last group's) and of the step, for ``tables`` tables, and
    the sync-prone ops of all ``K`` collects and of the step."""
    monkeypatch.setattr(fbgemm, "space_view", lambda *a, **k: None)  # no host replay view
    keys = [f"f{i}" for i in range(tables)]
    configs = [
        EmbeddingBagConfig(name=f"t{i}", num_embeddings=ROWS, embedding_dim=DIM, feature_names=[k])
        for i, k in enumerate(keys)
    ]
    ebc = fbgemm.FbgemmEmbeddingBagCollection(configs, "rowwise_adagrad", lr=0.05)
    ebc.capture.one_hot = True  # the trainer's rows hold one id per table
    opt = SparseRowwiseOptimizer(ebc.lookups(), lr=0.05, accumulate="merge", **opt_kw)
    opt.measure_steps = True
    rng = np.random.default_rng(tables)
    ids = torch.from_numpy(zipf_ranks(rng.random((BATCH, tables)), np.full(tables, ROWS), 1.05))
    up = torch.randn(BATCH, tables * DIM, generator=torch.Generator().manual_seed(0))
    b = BATCH // K
    collect, step = collections.Counter(), collections.Counter()
    staging = staging_buffers(opt)  # the merge's pair counts, staged on the host
    collect_syncs, step_syncs = SyncCounter(staging=staging), SyncCounter(staging=staging)
    for counting in (False, True):  # the second step: the first makes what is made once
        for j in range(K):
            kjt = KeyedJaggedTensor(
                keys=keys,
                values=ids[j * b : (j + 1) * b].t().reshape(-1),
                offsets=torch.arange(b * tables + 1),
                stride=b,
            )
            (ebc(kjt).values() * up[j * b : (j + 1) * b]).sum().div(b).backward()
            if counting:
                collect = counted(opt.collect, collect_syncs)
            else:
                opt.collect()
        if counting:
            step = counted(opt.step, step_syncs)
        else:
            opt.step()
    summary = opt.summary()  # the one read-back, on a logged step
    assert len(summary) == tables and all(t["touched_rows"] > 0 for t in summary)
    return collect, step, collect_syncs, step_syncs


def total(ops: collections.Counter) -> int:
    return sum(ops.values())


@pytest.mark.parametrize("opt_kw", [{"gsnr": True}, {"gsnr": True, "placement": "gradient"}])
def test_gsnr_step_and_collect_read_nothing_back(opt_kw, monkeypatch) -> None:
    collect, step, collect_syncs, step_syncs = device_route(6, monkeypatch, **opt_kw)
    for name in READ_BACKS:
        assert collect[name] == 0, (name, collect[name])
        assert step[name] == 0, (name, step[name])
    assert collect_syncs.total == 0, dict(collect_syncs.where)
    # every collect but the step's first reads the count the one before staged: K - 1 reads
    assert sum(collect_syncs.staged_reads.values()) == K - 1, collect_syncs.staged_reads
    # 6 tables of one dim, one row space: the last group's staged pair count (to cut its
    # padding off) and the ``unique`` that sizes the merged rows
    assert dict(step_syncs.kinds) == {"tolist": 1, "unique": 1}, dict(step_syncs.where)
    assert step["aten::index_add_"] > 0  # the step did run (the counter sees its ops)


def test_gsnr_op_count_does_not_grow_with_tables_and_is_within_plain(monkeypatch) -> None:
    """A loop over tables would add ops per table; the plain step (FBGEMM's fused kernel,
    replayed) is the yardstick: the GSNR step with its realised-ratio measure costs at most
    1.5x its ops."""
    few = device_route(3, monkeypatch, gsnr=True)
    many = device_route(12, monkeypatch, gsnr=True)
    assert total(few[0]) == total(many[0])  # collect
    assert total(few[1]) == total(many[1])  # step
    assert few[3].total == many[3].total  # the step's syncs
    _, plain, _, _ = device_route(12, monkeypatch)
    assert total(many[1]) <= 1.5 * total(plain), (total(many[1]), total(plain))


def test_views_address_a_gpu_tbe_in_its_device_buffers() -> None:
    """A TBE whose tables sit in ``weights_dev`` (``DEVICE`` placement), with a table of another
    dim between two of the same dim, as ``split_embedding_weights`` lays them out: the view's
    rows are the tables' rows, and writes land in the device buffer."""
    rows, dims = [5, 3, 4], [2, 3, 2]
    starts = [0, 10, 19]  # element offsets: t0 (5x2), t1 (3x3), t2 (4x2)
    weights = torch.arange(27, dtype=torch.float32)
    states = torch.arange(100, 112, dtype=torch.float32)  # row-wise sums: 5 + 3 + 4
    device = int(EmbeddingLocation.DEVICE)
    tbe = SimpleNamespace(
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        weights_physical_placements=[device] * 3,
        weights_physical_offsets=starts,
        momentum1_physical_placements=[device] * 3,
        momentum1_physical_offsets=[0, 5, 8],
        weights_dev=weights,
        momentum1_dev=states,
        weights_host=torch.zeros(0),
        momentum1_host=torch.zeros(0),
    )
    layout = LookupLayout.of([0, 1, 2], dims, rows)
    view = fbgemm.row_space_view(tbe, layout, layout.spaces[0])  # tables 0 and 2, dim 2
    assert view is not None and view.space.tables == (0, 2)
    global_rows = torch.tensor([4, 5, 8])  # t0 row 4, t2 rows 0 and 3
    torch.testing.assert_close(
        view.gather(global_rows), torch.tensor([[8.0, 9.0], [19.0, 20.0], [25.0, 26.0]])
    )
    torch.testing.assert_close(view.gather_states(global_rows), torch.tensor([104.0, 108, 111]))
    view.add_(global_rows, torch.ones(3, 2))
    view.put_states_(global_rows, torch.zeros(3))
    assert weights[[8, 9, 19, 20, 25, 26]].tolist() == [9.0, 10, 20, 21, 26, 27]
    assert weights[10:19].tolist() == list(range(10, 19))  # table 1 untouched
    assert states[[4, 8, 11]].tolist() == [0.0, 0.0, 0.0] and states[5:8].tolist() == [
        105,
        106,
        107,
    ]
    tbe.weights_physical_placements = [device, device, int(EmbeddingLocation.MANAGED_CACHING)]
    with pytest.raises(ValueError, match="MANAGED_CACHING"):
        fbgemm.row_space_view(tbe, layout, layout.spaces[0])

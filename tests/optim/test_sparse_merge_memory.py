"""Memory of the GPU's route (``accumulate="merge"``, :class:`GroupRows`), run on the CPU: what
it holds between collects is bounded by one micro-batch's padded slots plus the distinct pairs
of the earlier groups, not by one padded slot per looked-up id of every group.

The capture hands each micro-batch's row gradients padded to one slot per looked-up id
(``static_size``); a group's pairs (its distinct rows: the capture sums a row's ids within the
group) are usually far fewer. Held bytes are counted as the storages of every tensor the
accumulators keep (a slice that keeps its padded buffer alive counts in full).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import dlrm_vrgd.embedding.fbgemm as fbgemm
from dlrm_vrgd.data.synthetic import zipf_ranks
from dlrm_vrgd.optim.sparse import SparseRowwiseOptimizer

TABLES, ROWS, DIM, MICRO, A = 4, 2_000, 8, 2_048, 8
#: Bytes a padded slot holds: rows and groups (int64 each), the D-vector (fp32), ``valid``
#: (bool); no sample count (``count_ids`` is CowClip's only).
PADDED_SLOT = 8 + 8 + 4 * DIM + 1
#: Bytes a pair holds once the padding is cut off: rows, groups, gradient.
PAIR = 8 + 8 + 4 * DIM
#: The host's staging buffer of pair counts (a few int64) and rounding.
SLACK = 1024


def held_bytes(obj: object, seen: set[int] | None = None) -> int:
    """Bytes of the storages of every tensor reachable from ``obj`` through lists, tuples,
    dicts, dataclasses and the accumulators' own attributes, each storage once."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()
    if isinstance(obj, list | tuple):
        return sum(held_bytes(x, seen) for x in obj)
    if isinstance(obj, dict):
        return sum(held_bytes(x, seen) for x in obj.values())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(held_bytes(getattr(obj, f.name), seen) for f in dataclasses.fields(obj))
    return 0


def test_merge_holds_one_padded_group_and_the_others_pairs() -> None:
    keys = [f"f{i}" for i in range(TABLES)]
    configs = [
        EmbeddingBagConfig(name=f"t{i}", num_embeddings=ROWS, embedding_dim=DIM, feature_names=[k])
        for i, k in enumerate(keys)
    ]
    ebc = fbgemm.FbgemmEmbeddingBagCollection(configs, "rowwise_adagrad", lr=0.05)
    ebc.capture.one_hot = True
    opt = SparseRowwiseOptimizer(ebc.lookups(), lr=0.05, gsnr=True, accumulate="merge")
    (accs,) = opt._acc
    (acc,) = accs  # four tables of one dim: one row space
    rng = np.random.default_rng(0)
    ids_per_group = MICRO * TABLES  # one id per bag and table
    padded_group = ids_per_group * PADDED_SLOT
    pairs_before = 0  # bytes of the earlier groups' pairs
    held = []
    for j in range(A):
        ids = torch.from_numpy(zipf_ranks(rng.random((MICRO, TABLES)), np.full(TABLES, ROWS), 1.2))
        kjt = KeyedJaggedTensor(
            keys=keys,
            values=ids.t().reshape(-1),
            offsets=torch.arange(MICRO * TABLES + 1),
            stride=MICRO,
        )
        up = torch.randn(MICRO, TABLES * DIM, generator=torch.Generator().manual_seed(j))
        (ebc(kjt).values() * up).sum().backward()
        opt.collect()
        held.append(held_bytes(vars(acc)))
        # by hand: this group padded, the earlier ones cut to their pairs
        bound = padded_group + pairs_before + SLACK
        assert held[-1] <= bound, (j, held[-1], bound, padded_group)
        global_rows = ids + torch.arange(TABLES) * ROWS  # the row space's numbering
        pairs_before += torch.unique(global_rows).numel() * PAIR
    # the skew: a group's distinct rows are a fraction of its ids
    assert pairs_before < 0.3 * A * ids_per_group * PAIR
    # at A = 8: one padded group and seven groups' pairs, not eight padded groups
    assert held[-1] < 3 * padded_group, (held, padded_group)
    assert held[-1] - held[0] < (A - 1) * padded_group / 3, (held, padded_group)
    opt.step()  # the merge still runs
    assert held_bytes(vars(acc)) <= SLACK

"""Hostile configs for property tests: the tiny config with one field replaced by a value a
careless or hostile user might send (non-finite floats, huge ints, bools, wrong types)."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import strategies as st

from .conftest import tiny_config_dict

#: Dotted fields of the tiny config (and a few it leaves at their defaults) to attack.
FIELDS = [
    "data.train_rows", "data.val_rows", "data.cardinalities", "data.signal_scale",
    "data.click_rate", "data.zipf_exponent", "data.num_dense", "data.chunk_rows", "data.seed",
    "model.embedding_dim", "model.dense_arch", "model.over_arch", "model.dcn_low_rank_dim",
    "optim.dense.lr", "optim.dense.eps", "optim.dense.weight_decay", "optim.dense.betas",
    "optim.dense.trust_coefficient", "optim.dense.gamma", "optim.sparse.lr",
    "optim.sparse.replay_chunk_rows", "optim.schedule.warmup_steps",
    "run.global_batch", "run.micro_batch", "run.steps", "run.epochs", "run.eval_batch",
    "run.eval_every", "run.seed", "run.threads", "run.collective_timeout_s", "run.nnodes",
    "run.keep_checkpoints", "run",
]  # fmt: skip

HUGE = [2**31, 2**40 + 1, 2**63, 10**30, 10**400]

hostile_values = st.one_of(
    st.sampled_from([float("inf"), float("-inf"), float("nan"), 1e308, -1e308, 5e-324]),
    st.sampled_from(HUGE),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.booleans(),
    st.none(),
    st.text(max_size=8),
    st.sampled_from(["Infinity", "NaN", "1e999", "0x10", ""]),
    st.lists(st.sampled_from([True, float("inf"), 2**40, -1, "x"]), max_size=3),
    st.dictionaries(st.sampled_from(["a", "lr"]), st.integers(), max_size=2),
)


def with_value(field: str, value: Any, **overrides: Any) -> dict[str, Any]:
    """The tiny config (with ``overrides`` sections) with ``field`` set to ``value``."""
    raw = copy.deepcopy(tiny_config_dict(**overrides))
    node = raw
    *parents, last = field.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return raw


hostile_configs = st.builds(with_value, st.sampled_from(FIELDS), hostile_values)

"""The counter of the step's sync tests (:mod:`tests.optim.syncs`): every kind it names is
counted once, the ops that keep to the device are not, nor the reads of host tensors."""

from __future__ import annotations

import pytest
import torch

from .syncs import SyncCounter, count_syncs

x = torch.tensor([3.0, -1.0, 2.0, 2.0])
ids = torch.tensor([2, 0, 2, 5])
mask = x > 0
DEVICE = x.device  # what a device argument looks like on the CPU: an object, not a string

SYNCS = {
    "item": lambda: x[0].item(),
    "bool()": lambda: bool(mask[0]),
    "float()": lambda: float(x[0]),
    "int()": lambda: int(ids[0]),
    "tolist": lambda: x.tolist(),
    "cpu": lambda: x.cpu(),
    "numpy": lambda: x.numpy(),
    "to(cpu)": lambda: x.to("cpu"),
    "tensor(data, device=)": lambda: torch.tensor([1, 2], device=DEVICE),
    "new_tensor": lambda: x.new_tensor([1.0]),
    "unique": lambda: torch.unique(ids, return_inverse=True),
    "unique_consecutive": lambda: ids.unique_consecutive(),
    "nonzero": lambda: mask.nonzero(),
    "masked_select": lambda: x.masked_select(mask),
    "bincount": lambda: torch.bincount(ids, minlength=8),
    "equal": lambda: torch.equal(x, x),
    "allclose": lambda: x.allclose(x),
    "repeat_interleave (no output_size)": lambda: torch.repeat_interleave(x, ids),
    "bool-mask index": lambda: x[mask],
}


@pytest.mark.parametrize("kind", sorted(SYNCS))
def test_each_kind_is_counted_once(kind: str) -> None:
    counter = count_syncs(SYNCS[kind])
    assert dict(counter.kinds) == {kind: 1}
    assert counter.total == 1
    ((where_kind, place),) = counter.where
    assert where_kind == kind and place.startswith("tests/optim/test_syncs.py:")


def test_other_spellings_count_as_their_kind() -> None:
    def run() -> None:
        torch.where(mask)  # nonzero
        torch.argwhere(mask)  # nonzero
        y = x.clone()
        y[mask] = 0.0  # a boolean-mask write
        if mask.any():  # bool() of a device tensor
            pass
        # checked and sized by the ids' min and max: two scalar reads, made inside aten
        torch.nn.functional.one_hot(ids)

    counter = count_syncs(run)
    assert counter.kinds == {
        "nonzero": 2,
        "bool-mask index": 1,
        "_local_scalar_dense": 2,
        "bool()": 1,
    }


def test_device_only_ops_count_nothing() -> None:
    def run() -> None:
        keys, order = torch.sort(ids, stable=True)
        starts = torch.ones_like(keys, dtype=torch.bool)
        starts[1:] = keys[1:] != keys[:-1]
        run_of = torch.cumsum(starts, 0) - 1
        torch.zeros(4).index_add_(0, run_of, x[order])
        torch.searchsorted(run_of, torch.arange(4))
        torch.repeat_interleave(x, ids, output_size=9)
        torch.repeat_interleave(x, 2)  # a host int: the size is known
        x[torch.tensor([0, 2])]  # an integer index
        torch.where(mask, x, 0.0)
        torch.tensor([1.0, 2.0])  # made on the host
        torch.tensor([1.0], device="cpu")  # on the host by intent (torch.optim's Adam does it)
        x.new_full((), float("inf"))
        torch.stack([x.sum(), x.max()]).double()

    assert count_syncs(run).total == 0


@pytest.mark.parametrize("foreach", [False, True])
def test_host_step_counters_are_left_out(foreach: bool) -> None:
    """``torch.optim.AdamW`` reads its step counter (a host tensor, on a GPU too) with
    ``.item()`` and adds to it a host-made tensor: not syncs once the counter knows them."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1, foreach=foreach)

    def step() -> None:
        p.grad = torch.ones(3)
        opt.step()

    step()  # the state
    host = lambda t: any(t is st["step"] for st in opt.state.values())  # noqa: E731
    assert count_syncs(step, host).total == 0
    if not foreach:  # the single-tensor rule reads the counter: seen without ``host``
        assert count_syncs(step).kinds["item"] >= 1


def test_counts_accumulate_over_entries() -> None:
    """One counter entered once per micro-batch (as the step's collects are) sums them."""
    counter = SyncCounter()
    for _ in range(3):
        with counter:
            x.tolist()
        x.tolist()  # outside: not counted
    assert counter.kinds == {"tolist": 3}

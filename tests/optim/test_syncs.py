"""The counter of the step's sync tests (:mod:`tests.optim.syncs`): every kind it names is
counted once, the ops that keep to the device are not, nor the reads of host tensors, nor a
named staging buffer's read a region after its non-blocking fill (and nothing else like it)."""

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


class Staged:
    """A host staging buffer filled from a "device" tensor, as the merge stages its counts."""

    def __init__(self) -> None:
        self.buffer = torch.empty(4, dtype=torch.int64, device="cpu")
        self.counter = SyncCounter(staging=lambda t: t is self.buffer)

    def fill(self, non_blocking: bool = True) -> None:
        self.buffer[0].copy_(ids.sum(), non_blocking=non_blocking)


def test_a_staging_buffer_read_a_region_after_its_fill_is_left_out() -> None:
    """Filled non-blocking in one region (a collect), read in the next: the copy was enqueued a
    micro-batch before. Seen, and named, in ``staged_reads``."""
    s = Staged()
    with s.counter:
        s.fill()
    with s.counter:
        s.buffer.tolist()
    assert s.counter.total == 0
    (place,) = s.counter.staged_reads
    assert place.startswith("tests/optim/test_syncs.py:")


def test_a_staging_buffer_read_in_its_fills_region_counts() -> None:
    """Read right after its fill, the host would wait for the copy (and what came before)."""
    s = Staged()
    with s.counter:
        s.fill()
        s.buffer.tolist()
    assert s.counter.kinds == {"tolist": 1} and not s.counter.staged_reads


def test_a_staging_buffer_filled_by_a_blocking_copy_counts() -> None:
    s = Staged()
    with s.counter:
        s.fill(non_blocking=False)
    with s.counter:
        s.buffer.tolist()
    assert s.counter.kinds == {"copy_ to host": 1, "tolist": 1}


def test_a_staging_buffer_whose_fill_the_counter_did_not_see_counts() -> None:
    """The step reads the last collect's counts: filled under another counter, counted."""
    s = Staged()
    s.fill()
    with s.counter:
        s.buffer.tolist()
    assert s.counter.kinds == {"tolist": 1}


def test_a_device_read_a_region_later_still_counts() -> None:
    """Only the named buffer is left out: the device tensor its copy came from, read with
    ``.item()`` or ``.tolist()`` a region later, and another host buffer filled the same way
    but not named, count as before."""
    s = Staged()
    other = torch.empty(1, dtype=torch.int64, device="cpu")
    total = ids.sum()
    with s.counter:
        s.buffer[0].copy_(total, non_blocking=True)
        other.copy_(total, non_blocking=True)
    with s.counter:
        total.item()
        total.tolist()
        other.tolist()
        s.buffer.tolist()  # the one left out
    assert s.counter.kinds == {"item": 1, "tolist": 2}
    assert sum(s.counter.staged_reads.values()) == 1

"""A whole training step on the route a GPU takes, its host syncs counted on the CPU (issue 45).

:func:`~tests.optim.step_route.counted_step` runs two steps of a small DLRM-like model as the
trainer does (``A`` micro-batches, each collected; the dense and sparse steps; the noise scale;
the record read back on a logged step) and counts the sync-prone ops of the second, by kind
(:mod:`tests.optim.syncs`: scalar reads, ``tolist``, host-made device tensors, data-sized ops,
boolean-mask indexing, copies to the host). The step is asserted to:

* read nothing back in a collect (no sync per micro-batch);
* make as many syncs at ``A = 8`` as at ``A = 4``, and with 3 hidden layers in the top MLP
  as with 1 (no sync per micro-batch, none per dense tensor);
* add no sync outside the record when VRGD is on (dense VRGD and GSNR on the tables, realised
  step ratios measured), and at most 2 in all: the record's one batched read-back;
* read its record back in a small constant number of copies.

Counted at the time of writing (``A`` = 4 and 8 alike; 4 tables of one dim, one row space): plain 0
in the collects, 5 in the step, 3 in the record; VR 0, 2, 4. The VR step's two: the merge of the
table rows reads the last group's pair count (staged on the host at the last collect, a moment
before) and sizes the merged rows by a ``unique`` (the plain step makes both too; its other three
are FBGEMM's general replay in ``embedding/fbgemm.py``, which reads the rows' per-table counts back
and makes the tables' offsets from a list); the record's extra one is ``gsnr_summary``. Each collect
but the first reads the pair count that the one before staged in a host buffer (non-blocking, a
micro-batch earlier): left out by the counter's narrow rule for staging buffers
(:mod:`tests.optim.syncs`), and asserted to be the only read left out. Before issue 45 (the same
harness on the code it was filed against): plain 8/16 in the collects at A = 4/8, 5 in the step, 9
in the record; VR with VRSGD 8/16, 45, 9.
"""

from __future__ import annotations

import pytest

from .step_route import StepCounts, counted_step

#: Counted configurations, each run once per module: (dense, vr, A, layers, precision, measure).
_CACHE: dict[tuple[object, ...], StepCounts] = {}


def counts(
    dense: str = "vrsgd",
    vr: bool = True,
    a: int = 4,
    layers: int = 1,
    precision: str = "fp32",
    measure: bool = True,
) -> StepCounts:
    key = (dense, vr, a, layers, precision, measure)
    if key not in _CACHE:
        with pytest.MonkeyPatch.context() as mp:
            _CACHE[key] = counted_step(
                a, vr, dense=dense, layers=layers, precision=precision, measure=measure,
                monkeypatch=mp,
            )  # fmt: skip
    return _CACHE[key]


def outside_record(c: StepCounts) -> int:
    return c.collect.total + c.step.total


ROUTES = [pytest.param(False, id="plain"), pytest.param(True, id="vr")]


@pytest.mark.parametrize("vr", ROUTES)
@pytest.mark.parametrize("a", [4, 8])
def test_collects_read_nothing_back(vr: bool, a: int) -> None:
    c = counts(vr=vr, a=a)
    assert c.collect.total == 0, c.describe()
    # the one read left out (tests/optim/syncs.py): each collect but the first reads the pair
    # count the merge staged on the host at the collect before, one row space's
    staged = c.collect.staged_reads
    assert sum(staged.values()) == a - 1, staged
    assert {place.split(":")[0] for place in staged} == {"dlrm_vrgd/optim/sparse/accumulate.py"}


@pytest.mark.parametrize("vr", ROUTES)
def test_step_syncs_do_not_grow_with_micro_batches(vr: bool) -> None:
    """A sync per micro-batch (in a collect or kept for the step) would add 4 from A = 4 to 8."""
    four, eight = counts(vr=vr, a=4), counts(vr=vr, a=8)
    assert eight.step.total == four.step.total, (four.describe(), eight.describe())
    assert eight.total == four.total, (four.describe(), eight.describe())


@pytest.mark.parametrize("vr", ROUTES)
@pytest.mark.parametrize("dense", ["vrsgd", "vradam", "vrlars", "vrlamb", "vradagrad"])
def test_step_syncs_do_not_grow_with_dense_tensors(dense: str, vr: bool) -> None:
    """3 hidden layers instead of 1: 4 more dense tensors, each with its own statistics and
    update (VRLARS / VRLAMB: a trust ratio each)."""
    one, three = counts(dense, vr, layers=1), counts(dense, vr, layers=3)
    assert three.total == one.total, (one.describe(), three.describe())


@pytest.mark.parametrize(
    ("dense", "a"), [("vrsgd", 4), ("vrsgd", 8), ("vradam", 4), ("vrlars", 4), ("vrlamb", 4)]
)
def test_vrgd_adds_at_most_the_record_read_back(dense: str, a: int) -> None:
    """VRGD (dense ``dense`` and GSNR on the tables, ratios measured) against the plain step
    (its base optimizer, FBGEMM's kernel on the tables): nothing more outside the record, at
    most 2 in all."""
    plain, vr = counts(dense, False, a), counts(dense, True, a)
    assert outside_record(vr) <= outside_record(plain), (plain.describe(), vr.describe())
    assert vr.total - plain.total <= 2, (plain.describe(), vr.describe())


@pytest.mark.parametrize("vr", ROUTES)
def test_record_is_a_few_batched_copies(vr: bool) -> None:
    """The logged step's figures leave the device in one ``tolist`` each: the dense GSNR
    summary (VR), the tables' summary, and the noise scale's dense and table rows."""
    c = counts(vr=vr, a=8)
    assert set(c.record.kinds) <= {"tolist"}, c.describe()
    assert c.record.total <= 4, c.describe()
    assert c.record.total == counts(vr=vr, a=4, layers=3).record.total


def test_fp16_tables_add_no_sync() -> None:
    """Float16 tables round the step's writes stochastically, on the device."""
    fp32, fp16 = counts(a=4), counts(a=4, precision="fp16")
    assert fp16.total == fp32.total, (fp32.describe(), fp16.describe())


def test_unmeasured_step_syncs_no_more_than_a_measured_one() -> None:
    """A step whose figures the trainer does not log (``gsnr_every`` > 1) measures no step
    ratios; what it computes stays on the device unread."""
    measured, quiet = counts(a=4), counts(a=4, measure=False)
    assert outside_record(quiet) <= outside_record(measured), (
        measured.describe(),
        quiet.describe(),
    )

"""run.input resolved per source and device; the keys a rank asks for; which worker builds."""

from __future__ import annotations

import itertools

import pytest

from dlrm_vrgd.config import InputConfig
from dlrm_vrgd.data.pipeline.plan import InputPlan, block_affinity, rank_keys, resolve_plan


@pytest.mark.parametrize(
    ("source", "device", "cores", "expected"),
    [
        ("criteo", "cpu", 2, InputPlan("threads", 1, 2)),  # npy: one thread is enough
        ("criteo", "cuda", 16, InputPlan("threads", 1, 2)),
        ("synthetic", "cpu", 2, InputPlan("threads", 1, 2)),  # the step's threads use the cores
        ("synthetic", "cuda", 16, InputPlan("processes", 14, 28)),  # cores less 2, 2 ahead each
        ("synthetic", "cuda", 64, InputPlan("processes", 16, 32)),  # at most 16
        ("synthetic", "cuda", 2, InputPlan("processes", 1, 2)),  # at least 1
    ],
)
def test_auto_defaults_per_source_and_device(source, device, cores, expected) -> None:
    assert resolve_plan(InputConfig(), source, device, cores) == expected


def test_explicit_settings_win() -> None:
    cfg = InputConfig(builder="processes", workers=3, depth=5)
    assert resolve_plan(cfg, "criteo", "cpu", 2) == InputPlan("processes", 3, 5)
    assert resolve_plan(InputConfig(builder="threads", workers=4), "synthetic", "cuda", 16) == (
        InputPlan("threads", 4, 8)
    )
    assert resolve_plan(InputConfig(builder="serial", depth=9), "criteo", "cpu", 2) == (
        InputPlan("serial", 1, 0)
    )


def test_processes_fall_back_to_threads_without_fork(monkeypatch) -> None:
    import dlrm_vrgd.data.pipeline.plan as plan

    monkeypatch.setattr(plan, "can_fork", lambda: False)
    got = plan.resolve_plan(InputConfig(builder="processes", workers=2), "synthetic", "cpu", 8)
    assert got == InputPlan("threads", 2, 4)


def test_rank_keys_follow_the_steps_of_one_rank() -> None:
    # rank 1 of 2, A = 3: groups 3, 4, 5 of every step, steps below 3
    keys = list(rank_keys((1, 4), rank=1, accumulation=3, total_steps=3))
    assert keys == [(1, 4), (1, 5), (2, 3), (2, 4), (2, 5)]
    assert list(rank_keys((0, 0), 0, 2, 2)) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_rank_keys_start_with_any_key_asked_for() -> None:
    assert list(rank_keys((7, 0), 0, 2, total_steps=5)) == [(7, 0)]  # past the end: just it
    # a group of another rank (a caller that jumps) is first, then this rank's next step
    assert list(itertools.islice(rank_keys((0, 9), 0, 2, 10), 3)) == [(0, 9), (1, 0), (1, 1)]


def test_block_affinity_keeps_a_block_on_one_worker() -> None:
    # B = 64 rows, blocks of 256 rows, G = 1024: four consecutive keys share a block
    affinity = block_affinity(global_batch=1024, micro_batch=64, block_rows=256)
    assert [affinity((0, g)) for g in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert affinity((1, 0)) == 4  # step 1 starts at row 1024
    # micro-batches larger than a block take turns
    big = block_affinity(global_batch=4096, micro_batch=1024, block_rows=256)
    assert [big((0, g)) for g in range(4)] == [0, 1, 2, 3]

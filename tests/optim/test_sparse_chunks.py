"""The sparse step's blend, telemetry and CowClip go ``chunk_rows`` touched rows at a time, so
their ``rows x D`` temporaries are bounded by the chunk, not by the step's touched rows — and
the result is the formulas' (the reference of test_sparse_placement, written from DESIGN.md 4.3),
whatever the chunk."""

from __future__ import annotations

import pytest
import torch

from dlrm_vrgd.optim.sparse import CowClip, SparseRowwiseOptimizer

from .test_sparse_placement import (
    BACKENDS,
    EPS,
    GAMMA,
    GROUP_IDS,
    LR,
    ROWS,
    group_row_grads,
    reference_ratio,
    run_step,
)

TOUCHED = torch.tensor(sorted({i for ids in GROUP_IDS for i in ids}))  # 5 rows


class GatherSizes:
    """Wraps the gathers and writes of a lookup's row-space views to record how many rows each
    one got."""

    def __init__(self, lookup) -> None:
        self.sizes: list[int] = []
        for view in lookup.space_views():
            for name in ("gather", "gather_states", "add_", "put_", "put_states_"):
                setattr(view, name, self._wrap(getattr(view, name)))

    def _wrap(self, fn):
        def wrapped(rows, *rest):
            self.sizes.append(rows.numel())
            return fn(rows, *rest)

        return wrapped


@pytest.mark.parametrize("measure", [True, False])
@pytest.mark.parametrize("backend_name", sorted(BACKENDS))
def test_update_placement_in_chunks_of_two_rows_equals_reference(
    backend_name: str, measure: bool
) -> None:
    backend = BACKENDS[backend_name]()
    opt = SparseRowwiseOptimizer(backend.lookups, lr=LR, gsnr=True, gamma=GAMMA, chunk_rows=2)
    opt.measure_steps = measure
    seen = GatherSizes(backend.lookups[0])
    w = backend.weights().detach().clone().double()
    s = torch.zeros(ROWS, dtype=torch.float64)
    for step in range(3):
        g = group_row_grads(step)
        r = reference_ratio(g, TOUCHED, GAMMA)
        mean = g.mean(0)[TOUCHED]
        s[TOUCHED] += mean.square().mean(1)  # s_row += mean_D(ḡ²); w −= lr·r·ḡ/(√s + ε)
        w[TOUCHED] -= LR * (r / (s[TOUCHED].sqrt() + EPS))[:, None] * mean
        run_step(backend, opt, step)
        torch.testing.assert_close(backend.state().double(), s, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(backend.weights().detach().double(), w, rtol=1e-5, atol=1e-6)
        if measure:  # the telemetry over all chunks: every row moved by r_row
            entry = opt.summary()[0]
            assert entry["step_ratio_mean"] == pytest.approx(float(r.mean()), rel=1e-5)
    assert seen.sizes and max(seen.sizes) <= 2  # no gather or update spans more than a chunk


def test_cowclip_in_chunks_equals_one_chunk() -> None:
    """CowClip gathers the touched rows' weights a chunk at a time: chunks of 2 rows give the
    weights and the clip telemetry of one chunk of every row."""
    results = []
    for chunk in (2, 65_536):
        backend = BACKENDS["fbgemm"]()
        cc = CowClip(clip_ratio=0.05, zeta=1e-3, weight_decay=1e-2)
        opt = SparseRowwiseOptimizer(backend.lookups, lr=LR, cowclip=cc, chunk_rows=chunk)
        seen = GatherSizes(backend.lookups[0])
        for step in range(2):
            run_step(backend, opt, step)
        assert max(seen.sizes) <= chunk
        results.append((backend.weights().detach().clone(), opt.summary()[0]))
    (w_chunked, e_chunked), (w_whole, e_whole) = results
    assert 0.0 < e_whole["cowclip_clipped"] <= 1.0  # the clip acts, so the test can fail
    torch.testing.assert_close(w_chunked, w_whole, rtol=0, atol=0)
    assert e_chunked["cowclip_clipped"] == e_whole["cowclip_clipped"]
    assert e_chunked["cowclip_factor"] == pytest.approx(e_whole["cowclip_factor"], rel=1e-6)


@pytest.mark.parametrize("gsnr", [True, False])
def test_the_heap_is_handed_back_between_chunks(gsnr: bool, monkeypatch) -> None:
    """Each chunk allocates and frees ``chunk_rows x D`` temporaries; without glibc's free
    pages handed back between chunks the heap grew chunk by chunk (bench/memory.py: 118 MB over
    a 512k step). 5 touched rows in chunks of 2: three chunks, two hand-backs, none after the
    last (where the step's own end, or the next micro-batch's, follows)."""
    import dlrm_vrgd.malloc as malloc

    calls: list[int] = []
    monkeypatch.setattr(malloc, "release_free_memory", lambda: calls.append(1))
    backend = BACKENDS["fbgemm"]()
    opt = SparseRowwiseOptimizer(backend.lookups, lr=LR, gsnr=gsnr, gamma=GAMMA, chunk_rows=2)
    run_step(backend, opt, 0)
    assert len(calls) == 2

"""Run planning (``control/wire/runs.py``): the invariants both ends rely on
to agree on a batch's UCX messages without saying so on the wire."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings, strategies as st

from rpcbuf.control.wire.runs import COALESCE_MAX, RUN_MAX, plan_runs, run_tag

# Sizes around the thresholds, small ones often; gaps mostly zero (touching items).
SIZE = st.one_of(st.integers(0, 64), st.sampled_from([COALESCE_MAX - 1, COALESCE_MAX,
                                                      COALESCE_MAX + 1, RUN_MAX // 3]))
ITEMS = st.lists(st.tuples(SIZE, st.sampled_from([0, 0, 0, 1, -1, 4096])), max_size=60)


def _columns(items: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    offsets, sizes, at = [], [], 1 << 30
    for size, gap in items:
        at = max(0, at + gap)
        offsets.append(at)
        sizes.append(size)
        at += size
    return np.array(offsets, dtype=np.uint64), np.array(sizes, dtype=np.uint64)


@settings(max_examples=300, deadline=None)
@given(ITEMS)
def test_runs_partition_the_items_and_coalesce_greedily(items: list[tuple[int, int]]) -> None:
    offsets, sizes = _columns(items)
    runs = plan_runs(offsets, sizes)
    off, size = offsets.tolist(), sizes.tolist()
    # The runs cover items 0..n in order, each exactly once.
    bounds = [0, *(r[3] for r in runs)]
    assert [(r[2], r[3]) for r in runs] == list(itertools.pairwise(bounds))
    assert bounds[-1] == len(items)
    for start, nbytes, first, stop in runs:
        assert stop > first and start == off[first]
        assert nbytes == sum(size[first:stop])
        if stop - first > 1:  # a coalesced run: small items that touch, within RUN_MAX
            assert all(s <= COALESCE_MAX for s in size[first:stop])
            assert all(off[i + 1] == off[i] + size[i] for i in range(first, stop - 1))
            assert nbytes <= RUN_MAX
    # Greedy: no run could have taken the next item in.
    for (start, nbytes, first, stop), nxt in itertools.pairwise(runs):
        j = nxt[2]
        small = all(s <= COALESCE_MAX for s in size[first:stop]) and size[j] <= COALESCE_MAX
        assert not (small and off[j] == start + nbytes and nbytes + size[j] <= RUN_MAX)


def test_a_plain_store_is_a_batch_of_one_run() -> None:
    one = plan_runs(np.array([4096], np.uint64), np.array([RUN_MAX * 2], np.uint64))
    assert one == [(4096, RUN_MAX * 2, 0, 1)]
    assert plan_runs(np.zeros(0, np.uint64), np.zeros(0, np.uint64)) == []
    assert run_tag(7, 0) == 7  # run 0 on the request's own tag, as a plain store
    assert len({run_tag(7, i) for i in range(100)}) == 100


def test_touching_small_items_travel_together_up_to_run_max() -> None:
    n = 2 * RUN_MAX // COALESCE_MAX + 1
    sizes = np.full(n, COALESCE_MAX, np.uint64)
    offsets = (np.arange(n, dtype=np.uint64) * COALESCE_MAX).astype(np.uint64)
    runs = plan_runs(offsets, sizes)
    assert [r[1] for r in runs] == [RUN_MAX, RUN_MAX, COALESCE_MAX]
    big = plan_runs(np.array([0, COALESCE_MAX + 1], np.uint64),
                    np.array([COALESCE_MAX + 1, 8], np.uint64))
    assert len(big) == 2  # a large item travels alone

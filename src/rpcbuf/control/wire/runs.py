"""Run planning: consecutive small items whose ranges touch travel as one UCX
message (a *run*) landing straight in the arena; a large item travels alone.
Both ends call ``plan_runs`` on the same items, so they agree on messages and
tags with nothing said on the wire.  A plain store is one run tagged with its id.
"""

from __future__ import annotations

from typing import Any

import numpy as np

COALESCE_MAX = 256 << 10  # items up to this size travel together with their neighbours
RUN_MAX = 64 << 20  # the largest message a run of coalesced items makes

Run = tuple[int, int, int, int]  # (offset, nbytes, first item, stop item)


def plan_runs(offsets: np.ndarray, sizes: np.ndarray) -> list[Run]:
    """``(offset, nbytes, first, stop)`` per run, covering the items in order:
    touching items of at most ``COALESCE_MAX`` bytes, at most ``RUN_MAX`` a run
    (or one item).  Run ``i`` of request ``req_id`` is tagged ``run_tag(req_id, i)``."""
    runs: list[Run] = []
    start = end = first = 0
    small = False
    for i, (off, size) in enumerate(zip(offsets.tolist(), sizes.tolist(), strict=True)):
        fits = size <= COALESCE_MAX
        if i and small and fits and off == end and end - start + size <= RUN_MAX:
            end += size
            continue
        if i:
            runs.append((start, end - start, first, i))
        start, end, first, small = off, off + size, i, fits
    if len(offsets):
        runs.append((start, end - start, first, len(offsets)))
    return runs


def run_tag(req_id: int, index: int) -> Any:
    """The UCX tag of run ``index``; run 0 uses the request id itself, as a plain store does."""
    return req_id if index == 0 else (req_id, index)

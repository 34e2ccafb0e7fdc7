"""Run planning: how a batch's items travel over UCX, decided by both ends
with no I/O and nothing said on the wire.

A batch (``store_batch``, ``read_batch``) lists items as offsets and sizes.
Consecutive small items whose ranges touch are coalesced into one *run*: one
UCX message that lands straight in the arena span the run covers; a large
item travels alone (zero-copy on the client, no staging copy).  The client and
the daemon call ``plan_runs`` on the same items, so they agree on the messages
and their tags without a word about them in the request.  A plain store is
the batch of one item: one run, tagged with the request id.
"""

from __future__ import annotations

from typing import Any

import numpy as np

COALESCE_MAX = 256 << 10  # items up to this size travel together with their neighbours
RUN_MAX = 64 << 20  # the largest message a run of coalesced items makes

Run = tuple[int, int, int, int]  # (offset, nbytes, first item, stop item)


def plan_runs(offsets: np.ndarray, sizes: np.ndarray) -> list[Run]:
    """Group a batch's items into runs: ``(offset, nbytes, first, stop)``.

    Items ``first:stop`` of a run are consecutive, each at most
    ``COALESCE_MAX`` bytes (or the run holds one item), item ``i + 1``
    starting where item ``i`` ends, and the run at most ``RUN_MAX`` bytes
    unless it is one item.  The runs cover the items in order, each once.
    Run ``i`` of request ``req_id`` uses tag ``run_tag(req_id, i)``."""
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

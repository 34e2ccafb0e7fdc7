"""The staging area's piece cursor (``staging._PieceCursor``): pieces of any
sizes, zero-sized ones among them, gathered into slots of any size and
scattered back, byte for byte, whether a run of whole small pieces goes in
with one ``np.concatenate`` or piece by piece."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from rpcbuf.dataplane import staging


def _pieces(sizes: list[int], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 700), min_size=1, max_size=60),
       slot=st.integers(1, 3000), seed=st.integers(0, 1 << 16))
def test_pieces_go_through_slots_in_order(sizes: list[int], slot: int, seed: int) -> None:
    pieces = _pieces(sizes, seed)
    flat = np.concatenate(pieces) if pieces else np.empty(0, np.uint8)
    total = flat.nbytes
    gathered = np.zeros(total, np.uint8)
    into = staging._PieceCursor(pieces)
    for at in range(0, total, slot):
        into.copy(gathered[at:at + slot], True)
    assert np.array_equal(gathered, flat)
    back = [np.zeros_like(p) for p in pieces]
    out = staging._PieceCursor(back)
    for at in range(0, total, slot):
        out.copy(gathered[at:at + slot], False)
    assert all(np.array_equal(a, b) for a, b in zip(back, pieces, strict=True))


def test_many_small_pieces_take_the_bulk_path() -> None:
    pieces = _pieces([4096] * 1000 + [0, 7, 0, 4096 * 3], 1)
    cursor = staging._PieceCursor(pieces)
    assert cursor._whole(staging.RING_CHUNK) == 256  # 1 MiB of 4 KiB pieces at once
    slot = np.zeros(staging.RING_CHUNK, np.uint8)
    cursor.copy(slot, True)
    assert cursor.done == 256 and cursor.offset == 0
    assert np.array_equal(slot, np.concatenate(pieces[:256]))
    odd = staging._PieceCursor([p.view(np.uint32) for p in pieces[:16]] * 2)
    assert odd._whole(1 << 20) == 0  # not uint8: piece by piece

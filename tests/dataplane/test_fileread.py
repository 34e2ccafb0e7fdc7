"""Reading file ranges into an arena, hashed as they land (``dataplane/fileread.py``)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from rpcbuf.dataplane.arena import HostArena
from rpcbuf.dataplane.checksum import checksum, digest128
from rpcbuf.dataplane.fileread import Item, Outcome, ReadStopped, read_ranges

DATA = np.random.default_rng(5).integers(0, 256, 100_000, dtype=np.uint8)


@pytest.fixture
def fd(tmp_path: Path) -> Iterator[int]:
    (tmp_path / "f").write_bytes(DATA.tobytes())
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    yield fd
    os.close(fd)


def item(lo: int, hi: int, at: int) -> Item:
    piece = DATA[lo:hi]
    return Item(lo, hi - lo, at, digest128(piece), checksum(piece))


def far() -> float:
    return time.monotonic() + 60


@pytest.mark.parametrize("chunk", [1, 7, 4096, 1 << 20])
def test_ranges_land_where_asked_and_verify(fd: int, chunk: int) -> None:
    arena = HostArena(1 << 18)
    arena.view(0, 1 << 18)[:] = 0xAA
    items = [item(0, 300, 1000), item(5000, 5000, 0), item(700, 99_999, 2000)]
    if chunk == 1:
        items = items[:2]  # a byte at a time: keep it short
    out = read_ranges(fd, arena, items, Outcome(), deadline=far(), stopped=lambda: False,
                      chunk=chunk)
    assert (out.done, out.bad) == (len(items), None)
    assert out.nbytes == sum(i.nbytes for i in items)
    for i in items:
        assert np.array_equal(arena.view(i.arena_offset, i.nbytes),
                              DATA[i.file_offset:i.file_offset + i.nbytes])
    assert arena.view(300 + 1000, 1)[0] == 0xAA  # nothing past the items


def test_the_first_differing_item_is_named(fd: int) -> None:
    arena = HostArena(1 << 18)
    good, other = item(0, 100, 0), item(100, 200, 256)
    wrong = Item(100, 100, 256, other.digest ^ 1, other.checksum)  # its xxh3-128 is off
    out = read_ranges(fd, arena, [good, wrong, item(200, 300, 512)], Outcome(),
                      deadline=far(), stopped=lambda: False)
    assert (out.done, out.bad, out.ended_at) == (1, 1, None)
    assert out.written == [(0, 100), (256, 356)]  # the third was never touched
    short = Item(100, 100, 256, other.digest, other.checksum ^ 1)  # its xxh3-64 is off
    assert read_ranges(fd, arena, [short], Outcome(), deadline=far(),
                       stopped=lambda: False).bad == 0


def test_a_file_that_ends_inside_an_item(fd: int) -> None:
    arena = HostArena(1 << 18)
    past = Item(99_990, 100, 0, 0, 0)
    out = read_ranges(fd, arena, [past], Outcome(), deadline=far(), stopped=lambda: False)
    assert (out.bad, out.ended_at, out.nbytes) == (0, 100_000, 10)


def test_stop_and_deadline_end_it_within_a_chunk(fd: int) -> None:
    arena = HostArena(1 << 18)
    out = Outcome()
    calls = iter([False, False, True])
    with pytest.raises(ReadStopped):
        read_ranges(fd, arena, [item(0, 90_000, 0)], out, deadline=far(),
                    stopped=lambda: next(calls), chunk=1000)
    assert out.nbytes == 2000 and out.written == [(0, 90_000)]
    with pytest.raises(ReadStopped):
        read_ranges(fd, arena, [item(0, 10, 0)], Outcome(), deadline=time.monotonic() - 1,
                    stopped=lambda: False)


def test_no_byte_outside_the_arena(fd: int) -> None:
    arena = HostArena(4096)
    with pytest.raises(IndexError):
        read_ranges(fd, arena, [item(0, 100, 4000)], Outcome(), deadline=far(),
                    stopped=lambda: False)

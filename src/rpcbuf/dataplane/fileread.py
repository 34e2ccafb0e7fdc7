"""Ranges of a local file read straight into an arena, each hashed as it lands.

``read_ranges`` ``preadv``s each item into its arena slice, ``CHUNK`` bytes per call,
hashing every chunk while it is still in cache (xxh3-128 and xxh3-64 in one
pass); a device arena gets chunks through one host bounce buffer. It stops at the
first item whose hashes differ or that the file ends inside, and says which.

Buffered 8 MiB reads with ``POSIX_FADV_SEQUENTIAL``, no ``O_DIRECT`` (measured
fastest here: docs/performance.md). Runs in a worker thread; between chunks it
checks ``deadline`` and ``stopped``, so a late or orphaned load ends within one
chunk. It never writes outside the items' ranges (``arena.view`` checks again).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rpcbuf.dataplane.checksum import Digests
from rpcbuf.dataplane.cuda_arena import active, is_device_arena

CHUNK = 8 << 20


class ReadStopped(Exception):
    """The read was told to stop (its deadline passed, its session went away)."""


@dataclass(frozen=True, slots=True)
class Item:
    file_offset: int
    nbytes: int
    arena_offset: int
    digest: int  # the expected xxh3-128
    checksum: int  # the expected xxh3-64


@dataclass(slots=True)
class Outcome:
    """What ``read_ranges`` did: ``done`` items read and matching, ``nbytes`` in all;
    ``bad``: the item that did not match, ``ended_at``: where the file ended inside it."""

    done: int = 0
    nbytes: int = 0
    bad: int | None = None
    ended_at: int | None = None
    got: tuple[int, int] | None = None  # the bad item's (xxh3-128, xxh3-64), if read whole
    written: list[tuple[int, int]] = field(default_factory=list)  # arena ranges touched


def read_ranges(fd: int, arena: Any, items: Sequence[Item], out: Outcome, *,
                deadline: float, stopped: Callable[[], bool], chunk: int = CHUNK) -> Outcome:
    """Read and verify ``items`` of ``fd`` into ``arena`` in order; what happened goes
    into ``out`` (also on raise: ``out.written`` names ranges that may hold unverified
    bytes). ``ReadStopped`` past ``deadline`` or once ``stopped()``; OSError."""
    if not items:
        return out
    lo = min(i.file_offset for i in items)
    hi = max(i.file_offset + i.nbytes for i in items)
    try:
        os.posix_fadvise(fd, lo, hi - lo, os.POSIX_FADV_SEQUENTIAL)
    except OSError:
        pass  # a file system without read-ahead hints: read all the same
    device = is_device_arena(arena)
    bounce = np.empty(min(chunk, max(i.nbytes for i in items)), dtype=np.uint8) \
        if device else None
    for k, item in enumerate(items):
        digests = Digests()
        if item.nbytes:
            out.written.append((item.arena_offset, item.arena_offset + item.nbytes))
        view = arena.view(item.arena_offset, item.nbytes)
        host = None if device else view.data  # a flat uint8 slice: format "B"
        done = 0
        while done < item.nbytes:
            if stopped() or time.monotonic() > deadline:
                raise ReadStopped
            n = min(chunk, item.nbytes - done)
            if bounce is None:
                assert host is not None
                piece = host[done:done + n]
                got = os.preadv(fd, [piece], item.file_offset + done)
                digests.update(piece[:got])
            else:
                got = os.preadv(fd, [bounce.data[:n]], item.file_offset + done)
                digests.update(bounce[:got])
                with active(arena):
                    _to_device(view[done:done + got], bounce[:got])
            if got == 0:  # the file ends here (it shrank since it was checked)
                out.bad, out.ended_at = k, item.file_offset + done
                return out
            done += got
            out.nbytes += got
        if device:
            arena.synchronize()
        sums = (digests.digest128(), digests.checksum())
        if sums != (item.digest, item.checksum):
            out.bad, out.got = k, sums
            return out
        out.done += 1
    return out


def _to_device(dst: Any, src: np.ndarray) -> None:
    """Host to device: CuPy's ``set`` (the tests' NumPy-backed fake has none)."""
    if hasattr(dst, "set"):
        dst.set(src)
    else:
        dst[...] = src

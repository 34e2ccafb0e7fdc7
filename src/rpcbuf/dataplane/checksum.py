"""The checksum of stored bytes: xxh3-64 of the raw bytes, as an unsigned int.

One definition for both ends: the client hashes the bytes it sends, the daemon
hashes the arena slice it received into, and the two integers must match.
``digest128`` is the content key of dedup (xxh3-128), for both ends too;
``Digests`` computes both of bytes that arrive in pieces (a node-local load
reads a file a chunk at a time).
This is the only module that imports xxhash: everything hashes through it.

``digests`` gives both in one pass over the bytes.  XXH3's output is frozen
by its specification (since xxHash 0.8.0), and for inputs longer than 240
bytes the 64- and 128-bit variants run the same accumulation and the same
final merge for the low half: the low 64 bits of xxh3-128 *are* xxh3-64.
So a long input is read once (what dedup pays on every byte it uploads or
indexes); a short one is hashed twice, which costs nothing.  The property is
checked once at import on a fixed input; a build that broke it would fall
back to two passes (``ONE_PASS``), never to a wrong checksum.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import xxhash

# xxh3-64 of anything that is already a flat, C-contiguous buffer (bytes, a
# memoryview of bytes, a uint8 array's .data): the hot loops' form, no cast.
xxh3: Callable[[Any], int] = xxhash.xxh3_64_intdigest
_xxh128: Callable[[Any], int] = xxhash.xxh3_128_intdigest

LONG = 240  # inputs longer than this: low 64 bits of xxh3-128 == xxh3-64
_LOW = (1 << 64) - 1


def checksum(data: Any) -> int:
    """xxh3-64 of a C-contiguous buffer (anything with the buffer protocol:
    bytes, a NumPy array, ...), as an unsigned int: what the daemon states
    in a manifest's ``checksum``.  TypeError for a buffer that is not
    C-contiguous (``np.ascontiguousarray`` it first)."""
    return xxhash.xxh3_64_intdigest(memoryview(data).cast("B"))


def digest128(data: Any) -> int:
    """xxh3-128 of a contiguous buffer, as an int (what dedup keys on)."""
    return xxhash.xxh3_128_intdigest(memoryview(data).cast("B"))


class Digests:
    """Both hashes of bytes that arrive in pieces (a file read a chunk at a
    time): ``update`` each piece in order, then ``digest128`` and ``checksum``
    equal ``digest128(whole)`` and ``checksum(whole)``."""

    __slots__ = ("_long", "_short")

    def __init__(self) -> None:
        self._long = xxhash.xxh3_128()
        self._short = xxhash.xxh3_64()

    def update(self, data: Any) -> None:
        piece = memoryview(data).cast("B")
        self._long.update(piece)
        self._short.update(piece)

    def digest128(self) -> int:
        return int(self._long.intdigest())

    def checksum(self) -> int:
        return int(self._short.intdigest())
def _one_pass_holds() -> bool:
    probe = bytes(range(256)) * 5 + b"rpcbuf"  # 1286 bytes: past the short-input paths
    return all(_xxh128(probe[:n]) & _LOW == xxh3(probe[:n]) for n in (LONG + 1, 1024, 1286))


ONE_PASS = _one_pass_holds()


def digests(data: Any) -> tuple[int, int]:
    """``(digest128(data), checksum(data))`` of a contiguous buffer, reading
    a long one once (see the module docstring)."""
    view = memoryview(data).cast("B")
    long = _xxh128(view)
    if ONE_PASS and view.nbytes > LONG:
        return long, long & _LOW
    return long, xxh3(view)

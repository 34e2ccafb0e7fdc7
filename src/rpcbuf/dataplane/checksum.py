"""The checksum of stored bytes (xxh3-64, an unsigned int) and the dedup key
(xxh3-128), one definition for client and daemon; the only module importing xxhash.

``digests`` gives both in one pass: for inputs over 240 bytes the low 64 bits of
xxh3-128 are xxh3-64 (XXH3's output is frozen by its spec). The property is
checked at import; a build that broke it falls back to two passes (``ONE_PASS``),
never to a wrong checksum.
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
    """xxh3-64 of a C-contiguous buffer as an unsigned int. TypeError when it is not
    C-contiguous."""
    return xxhash.xxh3_64_intdigest(memoryview(data).cast("B"))


def digest128(data: Any) -> int:
    """xxh3-128 of a contiguous buffer, as an int (what dedup keys on)."""
    return xxhash.xxh3_128_intdigest(memoryview(data).cast("B"))


class Digests:
    """Both hashes of bytes arriving in pieces: ``update`` each in order."""

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
    """``(digest128(data), checksum(data))``, reading a long input once."""
    view = memoryview(data).cast("B")
    long = _xxh128(view)
    if ONE_PASS and view.nbytes > LONG:
        return long, long & _LOW
    return long, xxh3(view)

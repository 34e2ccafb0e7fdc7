"""The checksum of stored bytes: xxh3-64 of the raw bytes, as an unsigned int.

One definition for both ends: the client hashes the bytes it sends, the daemon
hashes the arena slice it received into, and the two integers must match.
``digest128`` is the content key of dedup (xxh3-128), for both ends too.
"""

from __future__ import annotations

from typing import Any

import xxhash


def checksum(data: Any) -> int:
    """xxh3-64 of a contiguous buffer (anything with the buffer protocol)."""
    return xxhash.xxh3_64_intdigest(memoryview(data).cast("B"))


def digest128(data: Any) -> int:
    """xxh3-128 of a contiguous buffer, as an int (what dedup keys on)."""
    return xxhash.xxh3_128_intdigest(memoryview(data).cast("B"))

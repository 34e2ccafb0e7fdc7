"""A sorted set of strings for listing block keys a page at a time: ``add`` and
``discard`` cost O(log n), a page after any key O(log n + page). Keys lie in sorted
chunks of at most ``2 * CHUNK``, each chunk's last key in ``_maxes`` for bisection
(sortedcontainers' layout, cut to the three operations the tier needs).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterator

CHUNK = 256  # keys per chunk after a split (a chunk splits past 2 * CHUNK)


class SortedKeys:
    __slots__ = ("_chunks", "_len", "_maxes")

    def __init__(self) -> None:
        self._chunks: list[list[str]] = []
        self._maxes: list[str] = []  # each chunk's last (largest) key
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def add(self, key: str) -> None:
        maxes, chunks = self._maxes, self._chunks
        if not chunks:
            chunks.append([key])
            maxes.append(key)
            self._len = 1
            return
        i = min(bisect_left(maxes, key), len(maxes) - 1)
        chunk = chunks[i]
        j = bisect_left(chunk, key)
        if j < len(chunk) and chunk[j] == key:
            return
        chunk.insert(j, key)
        maxes[i] = chunk[-1]
        self._len += 1
        if len(chunk) > 2 * CHUNK:
            chunks[i:i + 1] = [chunk[:CHUNK], chunk[CHUNK:]]
            maxes[i:i + 1] = [chunk[CHUNK - 1], chunk[-1]]

    def discard(self, key: str) -> None:
        maxes, chunks = self._maxes, self._chunks
        i = bisect_left(maxes, key)
        if i == len(maxes):
            return
        chunk = chunks[i]
        j = bisect_left(chunk, key)
        if j == len(chunk) or chunk[j] != key:
            return
        del chunk[j]
        self._len -= 1
        if chunk:
            maxes[i] = chunk[-1]
        else:
            del chunks[i], maxes[i]

    def since(self, start: str | None, inclusive: bool) -> Iterator[str]:
        """The keys from ``start`` on (``start`` itself only when ``inclusive``), lazily;
        not to be consumed across a change of the set."""
        chunks = self._chunks
        if start is None:
            i = j = 0
        else:
            find = bisect_left if inclusive else bisect_right
            i = find(self._maxes, start)
            if i == len(chunks):
                return
            j = find(chunks[i], start)
        while i < len(chunks):
            chunk = chunks[i]
            while j < len(chunk):
                yield chunk[j]
                j += 1
            i, j = i + 1, 0

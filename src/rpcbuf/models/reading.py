"""A model's tensors read for an upload, and their content hashes: from the hash
cache (``KnownHashes``), computed ahead in a thread while nodes answer buffer
requests (``HashAhead``), or as each batch is read (``read_batch``).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from rpcbuf.control.client.dedup import content_hashes
from rpcbuf.models.hashcache import HashCache, file_key, tensor_key
from rpcbuf.models.modelfile import ModelFile, TensorSpec

# The most bytes a slot reads, hashes and sends at once.  Each batch costs the
# node two requests (the dedup query, the store) and several ms of its CPU:
# on the 2-core VM sixteen 64 MiB batches of a 1 GiB load took 1.12 s
# (median of 12, alternated), batches ramping from 16 MiB up to 256 MiB 0.85 s.
DEFAULT_BATCH = 256 << 20
FIRST_BATCH = 16 << 20  # a slot's first batch: hashed and on the wire soon


def batches(specs: Sequence[TensorSpec], limit: int,
            first: int | None = None) -> Iterator[list[TensorSpec]]:
    """``specs`` in order, at most ``limit`` bytes a batch (a bigger tensor alone).
    With ``first``: a ramp from ``first`` doubling up to ``limit``, so the first bytes
    go out after little hashing and the rest in few batches."""
    cap = limit if first is None else max(1, min(first, limit))
    batch: list[TensorSpec] = []
    size = 0
    for s in specs:
        if batch and size + s.nbytes > cap:
            yield batch
            batch, size = [], 0
            cap = min(limit, 2 * cap)
        batch.append(s)
        size += s.nbytes
    if batch:
        yield batch


class KnownHashes:
    """Hashes from the ``HashCache``: file identities taken before anything is
    read; the cache is saved only if they are unchanged after the upload."""

    def __init__(self, model: ModelFile) -> None:
        self.model = model
        self.cache = HashCache()
        self.fkeys = [file_key(f) for f in model.files]
        self.hits = 0

    def _key(self, spec: TensorSpec) -> tuple[str, str]:
        file, offset = self.model.where(spec.name)
        return self.fkeys[file], tensor_key(spec.name, offset, spec.nbytes)

    def knows(self, spec: TensorSpec) -> bool:
        return self.cache.get(*self._key(spec)) is not None

    def lookup(self, batch: list[TensorSpec]) -> dict[str, tuple[int, int]]:
        out = {}
        for s in batch:
            got = self.cache.get(*self._key(s))
            if got is not None:
                out[s.name] = got
        self.hits += len(out)
        return out

    def record(self, batch: list[TensorSpec], hashes: dict[str, tuple[int, int]]) -> None:
        for s in batch:
            if s.name in hashes:
                self.cache.put(*self._key(s), hashes[s.name])

    def save(self) -> None:
        try:
            same = [file_key(f) for f in self.model.files] == self.fkeys
        except OSError:
            same = False
        if same:  # else a file changed while it was read: its hashes may mix old and new
            for k in set(self.fkeys):
                self.cache.touch(k)
            self.cache.save()


def read_batch(model: ModelFile, batch: list[TensorSpec], known: KnownHashes | None = None,
          ahead: dict[str, tuple[int, int]] | None = None
          ) -> tuple[dict[str, np.ndarray], dict[str, tuple[int, int]]]:
    """The batch's arrays (map views) and hashes, computed only for tensors
    neither ``ahead`` nor the cache knows."""
    arrays = model.read([s.name for s in batch])
    early = {n: ahead[n] for n in arrays if n in ahead} if ahead else {}
    cached = known.lookup([s for s in batch if s.name not in early]) \
        if known is not None else {}
    fresh = content_hashes({n: a for n, a in arrays.items()
                            if n not in cached and n not in early})
    if known is not None and (fresh or early):
        known.record(batch, {**early, **fresh})
    return arrays, {**cached, **early, **fresh}


class HashAhead:
    """Hashes tensors in file order in a worker thread while the nodes back new
    buffers (0.6-1 s per GiB, otherwise idle).  ``stop`` ends it at its next
    tensor; the upload's read-ahead hashes the rest."""

    def __init__(self, model: ModelFile, known: KnownHashes | None) -> None:
        self.hashes: dict[str, tuple[int, int]] = {}
        self._model, self._known = model, known
        self._stop = threading.Event()
        self._job = asyncio.ensure_future(asyncio.to_thread(self._run))

    def _run(self) -> None:
        known = self._known
        for group in batches(self._model.tensors, DEFAULT_BATCH):
            todo = [s.name for s in group if known is None or not known.knows(s)]
            for n, a in (self._model.read(todo) if todo else {}).items():
                if self._stop.is_set():
                    return
                self.hashes.update(content_hashes({n: a}))

    async def finish(self) -> dict[str, tuple[int, int]]:
        """Every tensor hashed (a clone is decided by them); a file error ends it
        early with what it has."""
        await asyncio.wait([self._job])
        return self.hashes

    async def stop(self) -> dict[str, tuple[int, int]]:
        """Stop at the next tensor and wait for it, even when cancelled (the thread
        reads the mapping the caller closes after); the hashes so far."""
        self._stop.set()
        cancelled = False
        while not self._job.done():
            try:
                await asyncio.wait([self._job])
            except asyncio.CancelledError:
                cancelled = True
        if cancelled:
            raise asyncio.CancelledError
        if not self._job.cancelled():
            self._job.exception()  # a file that vanished: the upload will say so
        return self.hashes


# Tensors' hashes known before anything is read, by name: ``KnownHashes.lookup``
# (the hash cache) or a node-local load's hash manifest.
HashLookup = Callable[[list[TensorSpec]], dict[str, tuple[int, int]]]

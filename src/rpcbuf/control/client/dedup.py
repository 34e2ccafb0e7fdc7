"""Client side of content-hash dedup: send only what the daemon does not hold.

Each tensor is hashed (xxh3-128 to find it, xxh3-64 to verify it); one round
trip asks the daemon to place the contents this tenant holds, and the rest
goes in one ``store_batch`` with the manifest: the same manifest as
``store_tensors`` records.  Big batches hash in a thread (xxhash drops the
GIL); ``hashes`` skips it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from rpcbuf.control.client.connection import Caller
from rpcbuf.control.client.rangeops import RangeOps
from rpcbuf.control.client.tensorops import TensorOps
from rpcbuf.control.client.tensors import (
    Packed,
    named_arrays,
    plan_layout,
    with_bits,
)
from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.manifest import Source, source_columns
from rpcbuf.control.wire.units import THREAD_BYTES
from rpcbuf.dataplane.checksum import digests

CHUNK_ITEMS = P.MAX_ITEMS // 2  # two hash words per item must fit one packed array


def content_hashes(arrays: Mapping[str, np.ndarray]) -> dict[str, tuple[int, int]]:
    """``{name: (xxh3-128, xxh3-64)}``, each array read once."""
    return {n: digests(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
            for n, a in arrays.items()}


class DedupOps:
    def __init__(self, check_open: Callable[[], None], caller: Caller, manifests: TensorOps,
                 store: RangeOps) -> None:
        self._check_open, self._call = check_open, caller.call
        self._manifests, self._store = manifests, store

    async def store_tensors_dedup(self, buffer_id: str, tensors: Mapping[str, Any],
                                  offsets: Mapping[str, int] | None, verify: str | None,
                                  hashes: Mapping[str, tuple[int, int]] | None,
                                  sources: Mapping[str, Source] | None) -> dict[str, Any]:
        self._check_open()
        arrays, bits = named_arrays(tensors)
        sources = with_bits(sources, bits)
        if offsets is None:
            existing = await self._manifests.manifest_of(buffer_id)  # the cached copy when current
            offsets = plan_layout(arrays, existing)
        if hashes is None:
            total = sum(a.nbytes for a in arrays.values())
            hashes = await asyncio.to_thread(content_hashes, arrays) \
                if total >= THREAD_BYTES else content_hashes(arrays)
        names = sorted(arrays, key=lambda n: offsets[n])
        placed: set[str] = set()
        for start in range(0, len(names), CHUNK_ITEMS):
            placed |= await self._dedup_chunk(buffer_id, names[start:start + CHUNK_ITEMS],
                                              arrays, offsets, hashes, sources)
        missing = [n for n in names if n not in placed]
        if missing:
            await self._store.store_batch(
                buffer_id, [(offsets[n], arrays[n]) for n in missing], verify,
                _manifest(arrays, missing, sources), None,
                [hashes[n][1] for n in missing])  # hashed once, above
        return {"tensors": len(names), "placed": len(placed), "sent": len(missing),
                "bytes_placed": sum(int(arrays[n].nbytes) for n in placed),
                "bytes_sent": sum(int(arrays[n].nbytes) for n in missing)}

    async def _dedup_chunk(self, buffer_id: str, names: Sequence[str],
                           arrays: Mapping[str, np.ndarray], offsets: Mapping[str, int],
                           hashes: Mapping[str, tuple[int, int]],
                           sources: Mapping[str, Source] | None = None) -> set[str]:
        items = [n for n in names if arrays[n].nbytes]
        if not items:
            return set()
        words = np.empty(2 * len(items), dtype="<u8")
        words[0::2] = [hashes[n][0] & 0xFFFF_FFFF_FFFF_FFFF for n in items]
        words[1::2] = [hashes[n][0] >> 64 for n in items]
        req = P.DedupStore(
            buffer_id=buffer_id,
            offsets=P.pack_u64([offsets[n] for n in items]),
            sizes=P.pack_u64([arrays[n].nbytes for n in items]),
            hashes=P.U64Array(words.tobytes()),
            checksums=P.pack_u64([hashes[n][1] for n in items]),
            **_manifest(arrays, items, sources).fields())
        result = await self._call(req)
        return {items[int(i)] for i in P.unpack_u64(result["placed"])}


def _manifest(arrays: Mapping[str, np.ndarray], names: list[str],
              sources: Mapping[str, Source] | None) -> Packed:
    return Packed.of_arrays(names, [arrays[n] for n in names]).described(
        *source_columns(names, sources))

"""The byte-range verbs: one array at an offset, many ranges of one buffer,
and the read-back check.

Each builds a ``Transfer`` and runs it over the session's paths, routed and
checked by what the daemon stated about the buffer (``Places``, filled by
every metadata answer, asked once when empty).  Same-host ops of our own
buffers go in place when they can (``OwnMaps``), else the daemon's way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from rpcbuf.control.client import batches
from rpcbuf.control.client.answers import BufferMeta, parse_meta
from rpcbuf.control.client.arrays import as_bytes, dtype_name, prepare, to_wire_f16
from rpcbuf.control.client.datapath import BufferPlace, DataPaths, Transfer
from rpcbuf.control.client.hello import HelloAnswer
from rpcbuf.control.client.mapped import OwnMaps
from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.errors import BadRequest, NotFound, VerifyFailed
from rpcbuf.control.wire.gpuops import check_wire_dtype
from rpcbuf.dataplane.checksum import checksum
from rpcbuf.dataplane.devsum import devsum, memory_kind

# The context's get_buffer_meta(buffer_id, tensors), which notes the place it answers.
MetaOf = Callable[[str, bool], Awaitable[dict[str, Any]]]

PLACES_MAX = 1 << 16  # buffers whose place a context remembers (oldest forgotten first)


class Places:
    """What the daemon stated about each buffer of one context."""

    def __init__(self, hello: HelloAnswer) -> None:
        self._hello = hello
        self._places: dict[str, BufferPlace] = {}

    def get(self, buffer_id: str) -> BufferPlace | None:
        return self._places.get(buffer_id)

    def note(self, meta: BufferMeta) -> None:
        places = self._places
        if len(places) >= PLACES_MAX and meta.buffer_id not in places:
            del places[next(iter(places))]
        places[meta.buffer_id] = BufferPlace(
            meta.gpu, self._hello.checksum_kind(meta.device_type, meta.device))

    def device_memory(self, buffer_id: str) -> None:
        """The buffer turned out to be device memory."""
        self._places[buffer_id] = BufferPlace(True, self._hello.checksum_kind("GPU", 0))

    def forget(self, buffer_id: Any) -> None:
        if isinstance(buffer_id, str):
            self._places.pop(buffer_id, None)


class RangeOps:
    def __init__(self, paths: DataPaths, places: Places, meta: MetaOf,
                 check_open: Callable[[], None], own: OwnMaps | None = None) -> None:
        self._paths, self._places, self._meta = paths, places, meta
        self._check_open = check_open
        self._own = own  # our host buffers in place (same host: ``mapped.py``)

    def store_now(self, buffer_id: str, array: Any, offset: int, sync: bool,
                  verify: str | None, wire_dtype: str | None) -> dict[str, Any] | None:
        """``store_tensor`` done in place, no coroutine at all; None: await
        ``store_tensor``."""
        own = self._own
        if own is None or not sync or verify is not None or wire_dtype is not None \
                or own.due() or not self._now(buffer_id, offset, array):
            return None
        self._check_open()
        data = as_bytes(array)
        if type(data) is np.ndarray and own.copy_now(buffer_id, offset, data, True):
            return {"nbytes": int(data.nbytes)}
        return None

    def read_now(self, buffer_id: str, offset: int, nbytes: int | None,
                 out: Any) -> np.ndarray | None:
        own = self._own
        if own is None or out is None or own.due() or not self._now(buffer_id, offset, out):
            return None
        self._check_open()
        target = as_bytes(out, writable=True)
        if nbytes is None:
            nbytes = int(target.nbytes)
        if type(nbytes) is not int or not 0 <= nbytes <= target.nbytes:
            return None
        if type(target) is np.ndarray and own.copy_now(buffer_id, offset, target[:nbytes],
                                                       False):
            return out
        return None

    def _now(self, buffer_id: Any, offset: Any, array: Any) -> bool:
        """Whether an op on ``array`` may go in place at once, asked before its
        bytes are taken: a host array, one of our host buffers whose place we
        know.  False: the usual way."""
        return type(buffer_id) is str and memory_kind(array) == "host" \
            and self._in_place(self._places.get(buffer_id), offset, ())

    def _in_place(self, place: BufferPlace | None, offset: Any, arrays: Sequence[Any]) -> bool:
        return self._own is not None and place is not None and not place.gpu \
            and type(offset) is int and all(type(a) is np.ndarray for a in arrays)  # place: str id

    async def place(self, buffer_id: str) -> BufferPlace | None:
        """Where the buffer lives, from this context's answers, else asked once.
        None for a bad id: the op itself then gets the daemon's refusal."""
        if not isinstance(buffer_id, str):
            return None
        place = self._places.get(buffer_id)
        if place is None:
            try:
                await self._meta(buffer_id, False)
            except NotFound:
                return None
            place = self._places.get(buffer_id)
        return place

    async def store_tensor(self, buffer_id: str, array: Any, offset: int, sync: bool,
                           verify: str | None, wire_dtype: str | None) -> Any:
        self._check_open()
        if verify not in (None, "checksum"):
            raise BadRequest(f"verify must be None or 'checksum', got {verify!r}")
        if wire_dtype is not None:
            check_wire_dtype(wire_dtype, dtype_name(array))
        kind = "devsum" if memory_kind(array) == "cuda" else None  # None: the buffer's own
        if wire_dtype is None:
            data, landed = as_bytes(array), None
        else:
            data, landed = to_wire_f16(array)
        coro = self.store(buffer_id, data, offset, verify, kind, wire_dtype, landed)
        if sync:
            return await coro
        return asyncio.get_running_loop().create_task(coro)

    async def store(self, buffer_id: str, data: Any, offset: int, verify: str | None,
                    kind: str | None = None, wire_dtype: str | None = None,
                    landed: Any = None) -> dict[str, Any]:
        """The ``store`` request of ``data``.  ``landed``: what the buffer will
        hold when it differs (wire fp16; the checksum covers it); ``kind``: the
        checksum (None: the buffer's)."""
        prepare(data)
        place = await self.place(buffer_id)
        if kind is None:
            kind = place.checksum_kind if place is not None else "xxh3"
        if verify is None and wire_dtype is None and landed is None \
                and self._in_place(place, offset, (data,)):
            assert self._own is not None
            if await self._own.store(buffer_id, offset, data):
                return {"nbytes": int(data.nbytes)}
        final = data if landed is None else landed
        digest = None
        if verify:
            digest = devsum(final) if kind == "devsum" else checksum(final)
        stated = kind if verify and kind != "xxh3" else None
        req = P.Store(buffer_id=buffer_id, offset=offset, nbytes=int(final.nbytes),
                      checksum=digest, verify=verify,  # type: ignore[arg-type]
                      checksum_kind=stated,  # type: ignore[arg-type]
                      wire_dtype=wire_dtype)  # type: ignore[arg-type]
        return await self._paths.run(buffer_id, place, _one(req, data, wire_dtype is None))

    async def read_buffer(self, buffer_id: str, offset: int, nbytes: int | None,
                          out: Any) -> np.ndarray:
        self._check_open()
        target = as_bytes(out, writable=True) if out is not None else None
        if nbytes is None:
            if target is not None:
                nbytes = int(target.nbytes)
            else:
                meta = parse_meta(await self._meta(buffer_id, True))
                nbytes = meta.size - offset
        if not isinstance(nbytes, int) or nbytes < 0:
            raise BadRequest(f"nbytes must be a non-negative int, got {nbytes!r}")
        if target is None:
            target = np.empty(nbytes, dtype=np.uint8)
        elif target.nbytes < nbytes:
            raise BadRequest(f"out holds {target.nbytes} bytes, {nbytes} requested")
        dest = target[:nbytes]
        prepare(dest)  # GPU work still using ``out`` finishes before it is overwritten
        place = await self.place(buffer_id)
        if self._in_place(place, offset, (dest,)):
            assert self._own is not None
            if await self._own.read(buffer_id, offset, dest):
                return out if out is not None else target
        req = P.Read(buffer_id=buffer_id, offset=offset, nbytes=nbytes)
        await self._paths.run(buffer_id, place, _one(req, dest, True), receive=True)
        return out if out is not None else target

    async def store_batch(self, buffer_id: str, items: Sequence[tuple[int, Any]],
                          verify: str | None, manifest: batches.Manifest | None,
                          manifest_version: int | None,
                          checksums: Sequence[int] | None) -> dict[str, Any]:
        self._check_open()
        t, in_order = batches.store_batch(buffer_id, items, verify, manifest, manifest_version,
                                          checksums=checksums)
        place = await self.place(buffer_id)
        req = t.request
        assert isinstance(req, P.StoreBatch)
        if verify is None and manifest is None and manifest_version is None \
                and self._in_place(place, 0, t.arrays):
            got = await self._batch_in_place(buffer_id, req.offsets, req.sizes, t.arrays, True)
            if got is not None:
                return in_order({"nbytes": got, "items": len(t.arrays), "messages": 0})
        return in_order(await self._paths.run(buffer_id, place, t))

    async def _batch_in_place(self, buffer_id: str, offsets: bytes, sizes: bytes,
                              arrays: Sequence[np.ndarray], store: bool) -> int | None:
        """A batch's sorted ranges in place when disjoint and within one op's
        bounds; their bytes, or None."""
        offs, lens = P.unpack_u64(offsets), P.unpack_u64(sizes)
        if len(offs) != len(arrays) or not len(offs):
            return None
        if len(offs) > 1 and (offs[1:] < offs[:-1] + lens[:-1]).any():
            return None
        own = self._own
        assert own is not None
        done = await (own.store_many if store else own.read_many)(
            buffer_id, offs.tolist(), list(arrays))
        return int(lens.sum()) if done else None

    async def read_batch(self, buffer_id: str,
                         ranges: Sequence[tuple[int, int]]) -> list[np.ndarray]:
        self._check_open()
        t, views = batches.read_batch(buffer_id, ranges)
        place = await self.place(buffer_id)
        req = t.request
        assert isinstance(req, P.ReadBatch)
        if not self._in_place(place, 0, t.arrays) or await self._batch_in_place(
                buffer_id, req.offsets, req.sizes, t.arrays, False) is None:
            await self._paths.run(buffer_id, place, t, receive=True)
        return views()

    async def verify_write(self, buffer_id: str, offset: int, array: Any) -> bool:
        data = as_bytes(array)
        if memory_kind(data) != "host":  # device memory: compare on the host
            data = data.get()
        back = await self.read_buffer(buffer_id, offset, int(data.nbytes), None)
        if not np.array_equal(back, data):
            first = int(np.flatnonzero(back != data)[0])
            raise VerifyFailed("read-back differs from the array",
                               {"offset": offset, "first_difference": first})
        return True


def _one(req: P.Store | P.Read, array: Any, inline: bool) -> Transfer:
    return Transfer(req, (array,), lambda: [array] if array.nbytes else [], inline)

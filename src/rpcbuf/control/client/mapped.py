"""Our own host buffers written and read in place (same host, docs/dataplane.md).

- The first store of a buffer asks for a write grant: a writable fd of its
  memfd and a slot of the session's grant page.  From then on stores and
  reads (batches without a manifest or check too) are copies into or out of
  our mapping, no round trip: each inside the slot's lock, only while the
  slot is LIVE.  A read never asks for a grant (it would cost a clone its
  shared memory).
- REVOKED: the next store asks again; ENDED, or any refusal (BUSY,
  UNSUPPORTED_DEVICE, a full page): the op goes the daemon's way, so the
  verbs answer exactly as without this.
- ``ctx.map`` asks for an explicit grant: other sessions' ops on the
  buffer are BUSY until it closes.
- A mapping the caller still holds arrays of is never unmapped under them.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from rpcbuf.control.client.attach import _unimport, check_segment
from rpcbuf.control.client.connection import Caller
from rpcbuf.control.client.handles import Handles
from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.errors import (
    BadRequest,
    Busy,
    ConnectionLost,
    NotFound,
    QuotaExceeded,
    UnsupportedDevice,
)
from rpcbuf.dataplane.grants import ENDED, GrantPage

THREAD_COPY = 4 << 20  # copies from this size run in a thread (the loop serves the rest)
YIELD_EVERY = 1e-3  # seconds of in-place ops between two turns of the event loop
BUSY_BACKOFF = 1.0  # seconds a buffer the daemon refused is not asked for again ...
INDEXED_BACKOFF = 60.0  # ... and one that holds recorded tensors (its manifest)
_REFUSED = (Busy, NotFound, QuotaExceeded, UnsupportedDevice)


def in_place_on() -> bool:
    """``RPCBUF_IN_PLACE=0`` turns writing in place off (for comparison, tests)."""
    return os.environ.get("RPCBUF_IN_PLACE", "1") != "0"


class _Mapping:
    __slots__ = ("array", "gen", "inode", "mm", "size", "slot", "words")

    def __init__(self, mm: mmap.mmap, size: int, slot: int, inode: int) -> None:
        self.mm, self.size, self.slot = mm, size, slot
        self.inode = inode  # of the memfd it maps (``map_buffer``'s ``have``)
        self.gen = -1
        self.words = (0, 0, 0)  # the slot's lock address, generation and state indices
        self.array = np.frombuffer(mm, dtype=np.uint8, count=size)


class _DeviceMapping:
    """A GPU buffer's CUDA VMM handle imported writable (``ctx.map`` only)."""

    def __init__(self, imported: Any, size: int) -> None:
        m = imported.mapping
        self.array: Any = imported.array[:size]
        # Unmapped when the last array over it is gone (as an attachment).
        self._done = weakref.finalize(m, _unimport, m.driver, m.ptr, m.nbytes, m._handle)
        del m, imported

    @classmethod
    def open(cls, record: tuple[int, int], size: int, alloc: int,
             device: Any) -> _DeviceMapping:
        from rpcbuf.dataplane.cuda_import import import_buffer

        _, fd = record
        if type(device) is not int:
            os.close(fd)
            raise ConnectionLost("the daemon's map_buffer answer is malformed")
        return cls(import_buffer(fd, alloc, device, writable=True), size)  # takes the fd

    def close(self) -> None:
        """Our array goes; the mapping with the last one the caller holds."""
        self.array = None


class MappedBuffer:
    """``ctx.map``'s answer: ``array``, writable, in place; ``close`` ends it."""

    def __init__(self, buffer_id: str, array: np.ndarray,
                 close: Callable[[], Any]) -> None:
        self.buffer_id, self.array, self._close = buffer_id, array, close
        self.size = int(array.nbytes)

    async def close(self) -> None:
        await self._close()


class OwnMaps:
    """This session's grants and mappings, by buffer id."""

    def __init__(self, caller: Caller, handles: Handles,
                 check_open: Callable[[], None]) -> None:
        self._caller, self._handles, self._check_open = caller, handles, check_open
        self._page: GrantPage | None = None
        self._maps: dict[str, _Mapping] = {}
        self._refused: dict[str, float] = {}  # buffer id -> when to ask again
        self._opening: dict[str, asyncio.Future[None]] = {}  # grants being asked for
        self._yielded = time.monotonic()  # when an op of ours last let the loop run
        self._copying = 0  # copies in flight (a thread's may outlive ``close``)
        self._closed = False
        #: in-place ops of this context (the daemon does not see them)
        self.counts = {"stores": 0, "reads": 0, "bytes_stored": 0, "bytes_read": 0,
                       "grants": 0, "fallbacks": 0}

    def due(self) -> bool:
        """Whether to let the loop run first (then ``yielded``): in-place ops
        never wait, so a loop of them would starve the connection's reader."""
        return time.monotonic() - self._yielded >= YIELD_EVERY

    def yielded(self) -> None:
        self._yielded = time.monotonic()

    def copy_now(self, buffer_id: str, offset: int, arr: np.ndarray, store: bool) -> bool:
        """The copy under a LIVE grant, with nothing to wait for; False: take
        the async way."""
        m = self._maps.get(buffer_id)
        if m is None:
            return False
        n = arr.nbytes
        if offset < 0 or offset + n > m.size or n >= THREAD_COPY:
            return False
        page = self._page
        if page is None or self._closed:
            return False
        lock, gen_at, state_at = m.words
        if not page.fast_enter(lock, gen_at, state_at, m.gen):
            return False
        try:
            if store:
                m.array[offset:offset + n] = arr
            else:
                arr[...] = m.array[offset:offset + n]
        finally:
            page.fast_give(lock)
        self._count(store, n)
        return True

    async def store(self, buffer_id: str, offset: int, data: np.ndarray) -> bool:
        """Copy ``data`` into the buffer in place; False: go the daemon's way."""
        return await self._copy_many(buffer_id, [offset], [data], True)

    async def read(self, buffer_id: str, offset: int, dest: np.ndarray) -> bool:
        return await self._copy_many(buffer_id, [offset], [dest], False)

    async def store_many(self, buffer_id: str, offsets: list[int],
                         datas: list[np.ndarray]) -> bool:
        return await self._copy_many(buffer_id, offsets, datas, True)

    async def read_many(self, buffer_id: str, offsets: list[int],
                        dests: list[np.ndarray]) -> bool:
        return await self._copy_many(buffer_id, offsets, dests, False)

    async def _copy_many(self, buffer_id: str, offsets: list[int], arrs: list[np.ndarray],
                         store: bool) -> bool:
        # Only a store asks for a grant: a read of a buffer we do not write
        # in place goes the daemon's way, so reading never costs the buffer
        # its shared memory (a clone's) or a writable copy (an attached one's).
        if self.due():  # the loop runs, then the context is checked again
            await asyncio.sleep(0)
            self.yielded()
            self._check_open()  # CONNECTION_LOST once the daemon died
        m = await self._live(buffer_id) if store else self._held(buffer_id)
        if m is None:
            return False
        if any(o < 0 or o + a.nbytes > m.size for o, a in zip(offsets, arrs, strict=True)):
            return False  # the daemon's way: OUT_OF_RANGE, as it says it
        page = self._page
        assert page is not None
        if not page.enter(m.slot, m.gen):  # taken back since ``_live``: ask once more
            m = await self._live(buffer_id) if store else None
            if m is None or not page.enter(m.slot, m.gen):
                self.counts["fallbacks"] += 1
                return False
        self._copying += 1
        try:
            nbytes = sum(int(a.nbytes) for a in arrs)
            buf = m.array
            if nbytes >= THREAD_COPY:
                await asyncio.to_thread(_copies, buf, offsets, arrs, store)
            else:
                _copies(buf, offsets, arrs, store)
        finally:
            page.give(m.slot)
            self._copying -= 1
            if self._closed and not self._copying:  # the last copy after ``close``
                page.close()
        self._count(store, nbytes)
        return True

    def _count(self, store: bool, nbytes: int) -> None:
        counts = self.counts
        counts["stores" if store else "reads"] += 1
        counts["bytes_stored" if store else "bytes_read"] += nbytes

    def _held(self, buffer_id: str) -> _Mapping | None:
        m = self._maps.get(buffer_id)
        page = self._page
        return m if m is not None and page is not None and page.live(m.slot, m.gen) else None

    async def _live(self, buffer_id: str) -> _Mapping | None:
        """Our mapping under a LIVE grant, asking for one if needed; None when
        refused."""
        m = self._maps.get(buffer_id)
        page = self._page
        if m is not None and page is not None:
            if page.live(m.slot, m.gen):
                return m
            if page.state(m.slot) == ENDED and page.generation(m.slot) == m.gen:
                self.forget(buffer_id)  # released: unmap it
            # (Another generation: a grant of ours being answered now, or the
            # slot another buffer's since ours was released: asking tells.)
        when = self._refused.get(buffer_id)
        if when is not None:
            if time.monotonic() < when:
                return None
            del self._refused[buffer_id]
        pending = self._opening.get(buffer_id)
        if pending is not None:  # another task of ours is asking: its grant may do
            await asyncio.shield(pending)
            m = self._held(buffer_id)
            if m is not None:
                return m
        try:
            return await self.open(buffer_id, explicit=False)
        except NotFound:
            self.forget(buffer_id)  # gone: its mapping goes with it
            backoff = BUSY_BACKOFF
        except _REFUSED:
            backoff = BUSY_BACKOFF
        except BadRequest as exc:  # holds recorded tensors: the daemon's way for good
            if exc.details.get("reason") != "indexed":
                raise
            backoff = INDEXED_BACKOFF
        if len(self._refused) >= 4096:
            self._refused.clear()
        self._refused[buffer_id] = time.monotonic() + backoff
        self.counts["fallbacks"] += 1
        return None

    async def open(self, buffer_id: str, explicit: bool,
                   timeout: float | None = None) -> Any:
        """Ask for a grant and map what comes with it; one request per buffer
        at a time (tasks storing at once share one grant)."""
        while (pending := self._opening.get(buffer_id)) is not None:
            await asyncio.shield(pending)
        done = self._opening[buffer_id] = asyncio.get_running_loop().create_future()
        try:
            return await self._open(buffer_id, explicit, timeout)
        finally:
            del self._opening[buffer_id]
            done.set_result(None)

    async def _open(self, buffer_id: str, explicit: bool, timeout: float | None) -> Any:
        had = self._maps.get(buffer_id)
        ans = await self._caller.call(P.MapBuffer(buffer_id=buffer_id, explicit=explicit,
                                                  have=had.inode if had is not None else 0),
                                      timeout)
        try:
            slot, size, alloc = ans["slot"], ans["size"], ans["alloc_size"]
            page, handle, gen = ans["page"], ans["handle"], ans.get("gen", -1)
            if not all(type(v) is int for v in (slot, size, alloc, gen)) \
                    or not 0 < size <= alloc:
                raise TypeError
            for pair in (page, handle):  # [tag, size] of a record on the handle channel
                if pair is not None and (type(pair) is not list or len(pair) != 2
                                         or not all(type(v) is int for v in pair)):
                    raise TypeError
        except (KeyError, TypeError):
            raise ConnectionLost("the daemon's map_buffer answer is malformed") from None
        if page is not None:
            tag, psize = page
            _, fd = await self._handles.fd_for(tag, timeout)
            try:
                new = GrantPage.open(fd, psize)
            except (ValueError, OSError):
                os.close(fd)
                raise ConnectionLost("the daemon's grant page is not what it said") from None
            if self._page is not None:
                self._page.close()
            self._page = new
        if self._page is None or not 0 <= slot < self._page.slots:
            raise ConnectionLost("the daemon granted a slot outside its grant page")
        if ans.get("device_type") == "GPU":  # explicit only: the daemon refuses the rest
            if handle is None or not explicit:
                raise ConnectionLost("the daemon granted a GPU buffer without its handle")
            return _DeviceMapping.open(await self._handles.fd_for(handle[0], timeout),
                                       size, alloc, ans.get("device"))
        m = self._maps.get(buffer_id)
        if handle is not None:
            tag, hsize = handle
            _, fd = await self._handles.fd_for(tag, timeout)
            try:
                if hsize != alloc:
                    raise ConnectionLost("the daemon's buffer handle is not its size")
                check_segment(fd, alloc, writable=True)
                mm = mmap.mmap(fd, alloc, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                inode = os.fstat(fd).st_ino
            finally:
                os.close(fd)
            if m is not None:
                _drop(m)
            m = self._maps[buffer_id] = _Mapping(mm, size, slot, inode)
        elif m is None:
            raise ConnectionLost("the daemon granted a buffer it never handed over")
        m.slot, m.gen = slot, gen
        m.words = self._page.words(slot)
        self.counts["grants"] += 1
        return m

    async def map(self, buffer_id: str) -> MappedBuffer:
        """``ctx.map``: an explicit grant (raises what the daemon answers)."""
        m = await self.open(buffer_id, explicit=True)
        dev = m if isinstance(m, _DeviceMapping) else None

        async def close() -> None:
            if dev is not None:
                dev.close()
            with contextlib.suppress(NotFound, ConnectionLost):
                await self._caller.call(P.UnmapBuffer(buffer_id=buffer_id))
        return MappedBuffer(buffer_id, m.array if dev is not None else m.array[:m.size], close)

    def forget(self, buffer_id: Any) -> None:
        """We released the buffer: its mapping goes (unless arrays of it live)."""
        m = self._maps.pop(buffer_id, None) if isinstance(buffer_id, str) else None
        if m is not None:
            _drop(m)

    def close(self) -> None:
        """Unmap what no array holds; the grant page once no copy is in flight."""
        self._closed = True
        maps, self._maps = self._maps, {}
        for m in maps.values():
            _drop(m)
        if self._page is not None and not self._copying:
            self._page.close()


def _copies(buf: np.ndarray, offsets: list[int], arrs: list[np.ndarray], store: bool) -> None:
    for off, a in zip(offsets, arrs, strict=True):
        n = int(a.nbytes)
        if store:
            buf[off:off + n] = a
        else:
            a[...] = buf[off:off + n]


def _drop(m: _Mapping) -> None:
    m.array = np.empty(0, dtype=np.uint8)
    with contextlib.suppress(BufferError, ValueError):  # arrays of it still live: the GC's
        m.mm.close()


__all__ = ["MappedBuffer", "OwnMaps"]

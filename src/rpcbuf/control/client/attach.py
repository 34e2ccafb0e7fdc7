"""Zero-copy, read-only views of buffers and blocks on this host.

- A host buffer's handle is its sealed memfd, mapped ``PROT_READ``: nothing
  can make its arrays writable.  A GPU buffer's is its CUDA VMM handle,
  imported read-only (a write faults).  While attached, the daemon refuses
  writes into the buffer (BUSY) and frees it only at the last detach.
- A block's handle is its tenant's segment, which the tenant's same-host
  sessions also map writable (``SegmentMaps``): sealed against resizing,
  not against writes.
- ``close`` detaches at once when no array of the view is alive; else the
  last array's end detaches (its bytes never change under it).  When the
  session ends, the daemon ends its attachments; live arrays keep the old
  pages mapped.
- ``SegmentMaps``: the session's read-write mappings of its tenant's block
  segments, one per segment, unmapped when the context closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import math
import mmap
import os
import stat
import threading
import weakref
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import numpy as np

from rpcbuf.control.client.arrays import check_framework, torch_view
from rpcbuf.control.client.connection import Caller, result_of
from rpcbuf.control.client.handles import Handles, check_read_only
from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.errors import BadRequest, ConnectionLost, RpcBufError
from rpcbuf.control.wire.manifest import RESERVED, np_dtype
from rpcbuf.dataplane import shm
from rpcbuf.dataplane.prefault import populate_pages

POPULATE_CHUNK = 2 << 20  # bytes of a mapping populated under the lock at a time


class Attachment:
    """One open attachment: the buffer's bytes, mapped read-only."""

    def __init__(self, buffer_id: str, meta: Mapping[str, Any], base: Any, owner: Any,
                 release: Callable[..., None], release_args: tuple[Any, ...],
                 detach: Callable[[str], asyncio.Future[Any] | None]) -> None:
        """``base``: the whole buffer as uint8; ``owner``: what every array
        keeps alive; ``release(*release_args)`` unmaps once ``owner`` is gone (it
        must not reference ``owner``)."""
        self.buffer_id = buffer_id
        self.size: int = meta["size"]
        self.device_type: str = str(meta.get("device_type") or "CPU")
        self.tensors_meta: dict[str, dict[str, Any]] = dict(meta.get("tensors") or {})
        self.manifest_version: int = int(meta.get("manifest_version") or 0)
        self._base: Any = base
        self.closed = False
        # When the last array over the mapping is gone: unmap, then detach
        # (the detach request lands in ``_sent``, for ``close`` to wait on).
        self._sent: list[asyncio.Future[Any]] = []
        self._done = weakref.finalize(owner, _release, release, release_args, detach,
                                      buffer_id, self._sent)
        del owner

    @classmethod
    def host(cls, buffer_id: str, meta: Mapping[str, Any], fd: int, nbytes: int,
             detach: Callable[[str], asyncio.Future[Any] | None],
             offset: int = 0) -> Attachment:
        """A host buffer's read-only memfd, mapped ``PROT_READ``, from ``offset``."""
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
        base = np.frombuffer(mm, dtype=np.uint8, count=int(meta["size"]), offset=offset)
        return cls(buffer_id, meta, base, base, _unmap, (mm,), detach)

    @classmethod
    def device(cls, buffer_id: str, meta: Mapping[str, Any], fd: int, nbytes: int,
               device: int, detach: Callable[[str], asyncio.Future[Any] | None]) -> Attachment:
        """A GPU buffer's CUDA VMM handle, imported read-only (CUDA cannot stop
        a hostile process importing it writable: docs/security.md)."""
        from rpcbuf.dataplane.cuda_import import import_buffer

        imported = import_buffer(fd, nbytes, device, writable=False)  # takes the fd
        m = imported.mapping
        base = imported.array[:int(meta["size"])]
        args = (m.driver, m.ptr, m.nbytes, m._handle)
        del imported
        return cls(buffer_id, meta, base, m, _unimport, args, detach)

    @property
    def address(self) -> int:
        base = self._live()
        return int(base.data.ptr) if self.device_type == "GPU" else int(base.ctypes.data)

    def _live(self) -> Any:
        if self._base is None:
            raise BadRequest(f"the attachment of {self.buffer_id} is closed")
        return self._base

    def array(self, offset: int = 0, nbytes: int | None = None) -> Any:
        """``nbytes`` (default: to the end) from ``offset``, read-only uint8."""
        base = self._live()
        if nbytes is None:
            nbytes = self.size - offset
        if type(offset) is not int or type(nbytes) is not int or offset < 0 or nbytes < 0 \
                or offset + nbytes > self.size:
            raise BadRequest(f"[{offset}, +{nbytes}) is outside the buffer of {self.size} bytes")
        return base[offset:offset + nbytes]

    def tensors(self, framework: str = "numpy") -> dict[str, Any]:
        """The manifest's tensors as of attach, by name, over the buffer's pages
        (NumPy, CuPy, or ``framework="torch"``).  BAD_REQUEST for another
        framework."""
        check_framework(framework)
        base = self._live()
        out: dict[str, Any] = {}
        for name, e in self.tensors_meta.items():
            if name not in RESERVED:
                arr = tensor_view(base, e, self.size)
                out[name] = arr if framework == "numpy" else torch_view(
                    arr, e.get("source_type"), e.get("logical_shape"))
        return out

    async def close(self) -> None:
        """End the attachment (deferred while arrays live)."""
        self.closed = True
        self._base = None  # the finalizer runs now if no array is left
        if self._sent:  # it did: the detach is on its way; let it land
            await asyncio.wait(self._sent)

    async def __aenter__(self) -> Attachment:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class _Sent:
    """An attach's answer, and its request id: what its handle comes under."""

    req_id = 0

    async def run(self, req_id: int, fut: asyncio.Future[dict[str, Any]],
                  answer: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
        self.req_id = req_id
        return result_of(await answer())


class Attacher:
    """The attach verbs of one context (``handles`` None: every attach is
    refused).  A closed view's detach is sent unless the session ``ended``."""

    def __init__(self, caller: Caller, handles: Handles | None, check_open: Callable[[], None],
                 ended: Callable[[], bool]) -> None:
        self._caller, self._handles = caller, handles
        self._check_open, self._ended = check_open, ended

    async def attach(self, buffer_id: str) -> Attachment:
        return await self._open("attach", buffer_id, None)

    async def attach_block(self, key: str) -> Attachment:
        return await self._open("attach_block", "", P.BlockAttach(key=key))

    async def _open(self, verb: str, buffer_id: str, req: P.Request | None) -> Attachment:
        self._check_open()
        if self._handles is None:
            raise BadRequest(f"{verb} needs the same-host path: a client on the daemon's "
                             "host, on its Unix socket", {"reason": "not_same_host"})
        return await open_attachment(self._caller, self._handles, buffer_id,
                                     self._caller.timeout, self._detach, req)

    async def _detach(self, buffer_id: str) -> None:
        if self._ended():
            return
        with contextlib.suppress(RpcBufError):
            await self._caller.call(P.Detach(buffer_id=buffer_id))


async def open_attachment(caller: Caller, handles: Handles, buffer_id: str,
                          timeout: float | None,
                          send_detach: Callable[[str], Any],
                          req: P.Request | None = None) -> Attachment:
    """``attach``, its handle from the handle channel, checked and mapped;
    anything wrong after the daemon said yes detaches again.  ``req``: another
    request that answers as ``attach`` does (``block_attach``)."""
    req = P.Attach(buffer_id=buffer_id) if req is None else req
    sent = _Sent()
    meta = await caller.call(req, moves=sent)
    nbytes, fd = await handles.fd_for(sent.req_id, timeout)
    if not isinstance(req, P.Attach):
        named = meta.get("buffer_id")
        if type(named) is not str or not named:
            os.close(fd)
            raise ConnectionLost("the daemon's attach answer names no buffer")
        buffer_id = named
    detach = detacher(asyncio.get_running_loop(), send_detach)
    try:
        size, alloc = meta.get("size"), meta.get("alloc_size")
        # A block lies at ``offset`` in its tenant's segment (the handle is the segment's).
        offset = meta.get("offset", 0)
        if type(size) is not int or type(alloc) is not int or type(offset) is not int \
                or not 0 <= size <= alloc or not 0 <= offset <= alloc - size \
                or nbytes != alloc:
            raise ConnectionLost("the daemon's attach answer does not match its handle")
        if meta.get("device_type") == "GPU":
            device = meta.get("device")
            if type(device) is not int or device < 0:
                raise ConnectionLost("the daemon's attach answer names no GPU")
            fd, took = -1, fd  # the import takes the fd
            if offset:
                raise ConnectionLost("the daemon's attach answer places a GPU buffer at an offset")
            return Attachment.device(buffer_id, meta, took, alloc, device, detach)
        if isinstance(req, P.BlockAttach):
            check_segment(fd, alloc, writable=False)
        else:
            check_read_only(fd, alloc)
        return Attachment.host(buffer_id, meta, fd, alloc, detach, offset)
    except BaseException:
        await send_detach(buffer_id)
        raise
    finally:
        if fd >= 0:
            os.close(fd)


def check_segment(fd: int, nbytes: int, writable: bool) -> None:
    """A segment's handle: a regular file of exactly ``nbytes``, opened as
    asked, sealed against resizing (no SIGBUS).  Raises CONNECTION_LOST."""
    st = os.fstat(fd)
    if st.st_size != nbytes or not stat.S_ISREG(st.st_mode):
        raise ConnectionLost(f"the daemon's segment handle is {st.st_size} bytes, not {nbytes}")
    mode = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
    if mode != (os.O_RDWR if writable else os.O_RDONLY):
        raise ConnectionLost("the daemon's segment handle has the wrong access mode")
    try:
        sealed = shm.seals(fd)
    except OSError:
        sealed = 0
    if not sealed & shm.F_SEAL_SHRINK:
        raise ConnectionLost("the daemon's segment handle can shrink (no F_SEAL_SHRINK)")


class SegmentMaps:
    """This session's mappings of its tenant's block segments.  ``views``
    maps the segments an answer hands and returns each block's bytes; no
    array of it may outlive the call that asked (``close`` unmaps)."""

    def __init__(self, handles: Handles) -> None:
        self._handles = handles
        self._maps: dict[str, tuple[int, int, np.ndarray]] = {}  # id -> (address, size, bytes)
        self.inodes: dict[str, int] = {}  # id -> its memfd's inode (what it is, for tests)
        # A mapping is unmapped only between two chunks of its populating (``_populate``).
        self._lock = threading.Lock()

    async def views(self, answer: Mapping[str, Any], sizes: list[int],
                    timeout: float | None) -> list[np.ndarray]:
        try:
            ids, maps = answer["segments"], answer["maps"]
            which = P.unpack_u64(answer["which"]).tolist()
            offsets = P.unpack_u64(answer["offsets"]).tolist()
            if not isinstance(ids, list) or not isinstance(maps, list) \
                    or len(which) != len(sizes) or len(offsets) != len(sizes):
                raise TypeError
            for m in maps:
                seg_id, tag, size = m
                if type(seg_id) is not str or type(tag) is not int or type(size) is not int:
                    raise TypeError
        except (KeyError, TypeError, ValueError, BadRequest):
            raise ConnectionLost("the daemon's block placement is malformed") from None
        for seg_id, tag, size in maps:
            _, fd = await self._handles.fd_for(tag, timeout)
            try:
                self._map(seg_id, fd, size)
            finally:
                os.close(fd)
        out = []
        for w, off, n in zip(which, offsets, sizes, strict=True):
            got = self._maps.get(ids[w]) if 0 <= w < len(ids) else None
            if got is None or off + n > got[1]:
                raise ConnectionLost("the daemon placed a block outside its segments")
            out.append(got[2][off:off + n])
        return out

    def _map(self, seg_id: str, fd: int, size: int) -> None:
        check_segment(fd, size, writable=True)
        with self._lock:
            old = self._maps.pop(seg_id, None)
            if old is not None:
                shm.unmap(old[0], old[1])
        addr = shm.map_shared(fd, size)
        self.inodes[seg_id] = os.fstat(fd).st_ino
        mem = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(addr))
        entry = self._maps[seg_id] = (addr, size, mem)
        threading.Thread(target=self._populate, args=(seg_id, entry), daemon=True,
                         name="rpcbuf-populate").start()

    def _populate(self, seg_id: str, entry: tuple[int, int, np.ndarray]) -> None:
        """In a thread: fault in every page of a new mapping
        (``MADV_POPULATE_WRITE``), off the put's path (a 2 MiB put: 1.49 ms
        unpopulated, 0.74 ms populated).  In chunks, each under the lock and only
        while the mapping is this one; a failure leaves the faults to the copies."""
        addr, size, _ = entry
        for off in range(0, size, POPULATE_CHUNK):
            with self._lock:
                if self._maps.get(seg_id) is not entry or \
                        populate_pages(addr + off, min(POPULATE_CHUNK, size - off)) != 0:
                    return

    def close(self) -> None:
        with self._lock:
            maps, self._maps = self._maps, {}
            for addr, size, _ in maps.values():
                shm.unmap(addr, size)

    def __len__(self) -> int:
        return len(self._maps)


def tensor_view(base: Any, entry: Mapping[str, Any], size: int) -> Any:
    """One manifest entry over ``base``; a malformed one (the daemon may be
    hostile) is CONNECTION_LOST, never an array past the mapping."""
    try:
        dtype = np_dtype(entry["dtype"])
        shape = tuple(map(int, entry["shape"]))
        offset, nbytes = int(entry["offset"]), int(entry["nbytes"])
    except (KeyError, TypeError, ValueError, BadRequest) as exc:
        raise ConnectionLost(f"the daemon sent a malformed manifest entry: {exc}") from None
    if offset < 0 or nbytes < 0 or offset + nbytes > size \
            or math.prod(shape) * dtype.itemsize != nbytes or min(shape, default=0) < 0:
        raise ConnectionLost("the daemon sent a manifest entry outside its buffer")
    return base[offset:offset + nbytes].view(dtype).reshape(shape)


def _release(release: Callable[..., None], args: tuple[Any, ...],
             detach: Callable[[str], asyncio.Future[Any] | None], buffer_id: str,
             sent: list[asyncio.Future[Any]]) -> None:
    with contextlib.suppress(Exception):  # a leak at worst, never a crash in a finalizer
        release(*args)
    task = detach(buffer_id)
    if task is not None:
        sent.append(task)


def _unmap(mm: mmap.mmap) -> None:
    with contextlib.suppress(BufferError, ValueError):
        mm.close()


def _unimport(driver: Any, ptr: int, nbytes: int, handle: int) -> None:
    """Release an imported GPU allocation; a failed unmap keeps the rest (a
    leak, never a range freed under a mapping)."""
    driver.synchronize()
    driver.unmap(ptr, nbytes)
    driver.release(handle)
    driver.free_address(ptr, nbytes)


def detacher(loop: asyncio.AbstractEventLoop,
             send: Callable[[str], Any]) -> Callable[[str], asyncio.Future[Any] | None]:
    """A detach callable from any thread (a finalizer): sent from ``loop``;
    on the loop's thread the task is returned, else nobody waits."""
    def go(buffer_id: str) -> asyncio.Future[Any]:
        task = loop.create_task(send(buffer_id))
        task.add_done_callback(_swallow)
        return task

    def detach(buffer_id: str) -> asyncio.Future[Any] | None:
        try:
            if asyncio.get_running_loop() is loop:
                return go(buffer_id)
        except RuntimeError:
            pass
        with contextlib.suppress(RuntimeError):  # the loop is closed: the session went too
            loop.call_soon_threadsafe(go, buffer_id)
        return None
    return detach


def _swallow(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()  # the session may be gone: it detached everything then

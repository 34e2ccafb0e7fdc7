"""The async client's verbs: ``RpcContext``, a session with one rpcbufd.

The context composes its parts and adds the verbs (their names, defaults and
docstrings are the contract; a verb with a part hands the call to it in one
line) and the session's life: connect, close, abort, and the open check
every verb makes first.

Many tasks may share one context: every call gets its own request id, the
daemon's ``max_inflight`` bounds the calls on the wire, and every wait of a
call is inside its timeout.  When the daemon goes away every pending call
fails with CONNECTION_LOST; none hangs.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from rpcbuf.control.client import fileload
from rpcbuf.control.client.answers import MAX_BLOCK_NBYTES
from rpcbuf.control.client.attach import Attacher, Attachment
from rpcbuf.control.client.blockops import BlockOps
from rpcbuf.control.client.bufferops import BufferOps
from rpcbuf.control.client.connection import ORPHAN_GRACE, Caller, ControlConnection
from rpcbuf.control.client.datapath import (
    DataPaths,
    InlineClientPath,
    StagedClientPath,
    UcxClientPath,
    inline_on,
)
from rpcbuf.control.client.dedup import DedupOps
from rpcbuf.control.client.handles import Handles
from rpcbuf.control.client.hello import HelloAnswer
from rpcbuf.control.client.mapped import MappedBuffer, OwnMaps, in_place_on
from rpcbuf.control.client.opening import (
    DEFAULT_PORT,
    Opening,
    TlsOption,
    check_unix_peer,
    open_session,
    parse_addr,
    same_host_default,
)
from rpcbuf.control.client.rangeops import Places, RangeOps
from rpcbuf.control.client.tensorops import TensorOps
from rpcbuf.control.client.tensors import ManifestTable, Packed
from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.errors import BadRequest, ConnectionLost, Timeout
from rpcbuf.control.wire.manifest import Source

__all__ = ["DEFAULT_PORT", "Opening", "RpcContext", "check_unix_peer",
           "parse_addr", "same_host_default"]


class RpcContext:
    """A session with one rpcbufd: see ``rpcbuf.connect``."""

    def __init__(self, conn: ControlConnection, hello: HelloAnswer, raw_hello: dict[str, Any],
                 timeout: float | None, max_inflight: int | None = None,
                 ucx_host: str = "127.0.0.1", handles: Handles | None = None) -> None:
        self._conn = conn
        #: the daemon's hello as it came (checked: ``hello.parse_hello``)
        self.hello = raw_hello
        #: True when this context's host arrays move by the same-host path
        self.same_host: bool = handles is not None and handles.area is not None
        self._handles = handles
        self.session_id: str = hello.session_id
        self.tenant: str = hello.tenant
        self.node_id: str = hello.node_id
        #: the protocol version this session speaks (``P.negotiate``)
        self.protocol_version: int = hello.version
        self.timeout = timeout
        limit = hello.max_inflight  # checked: 1 .. hello.MAX_INFLIGHT
        self.max_inflight = limit if max_inflight is None else max(1, min(max_inflight, limit))
        self._caller = Caller(conn, self.max_inflight, timeout)
        self.transfer_timeout = hello.transfer_timeout + 5.0
        # A copy the daemon had started when we went away ends by its deadline.
        conn.orphan_grace = max(ORPHAN_GRACE, self.transfer_timeout)
        self._closed = False
        self._pid = os.getpid()  # a context belongs to the process that opened it
        self._paths = DataPaths(
            UcxClientPath(self._caller, ucx_host, hello.ucx_port, hello.bind_nonce,
                          self.transfer_timeout, self._expired, self._check_open),
            StagedClientPath(self._caller, handles.staging, self.transfer_timeout)
            if handles is not None and handles.staging is not None else None,
            InlineClientPath(self._caller, hello.inline_max) if hello.inline_max and inline_on()
            else None)
        self._places = Places(hello)  # what the daemon stated about each buffer
        self._paths.on_device_memory = self._places.device_memory
        # Our host buffers written and read in place (``mapped.py``).
        self._own = OwnMaps(self._caller, handles, self._check_open) \
            if handles is not None and self.same_host else None
        self._ranges = RangeOps(self._paths, self._places, self.get_buffer_meta,
                                self._check_open, self._own if in_place_on() else None)
        self._tensors = TensorOps(self._ranges, self.get_buffer_meta)
        self._buffers = BufferOps(self._caller, self._places, self._tensors, self._check_open)
        self._dedup = DedupOps(self._check_open, self._caller, self._tensors, self._ranges)
        self._blocks = BlockOps(self._caller, self._paths, self._check_open,
                                handles if self.same_host else None, hello.block_inline)
        self._attacher = Attacher(self._caller, handles if self.same_host else None,
                                  self._check_open,
                                  lambda: self._closed or self._conn.lost is not None)
        # Without its control session the daemon drops the data endpoint too:
        # abort ours at once so posted UCX requests fail instead of waiting.
        conn.on_lost = self._paths.ucx.abort

    # -- plumbing -----------------------------------------------------------------

    @classmethod
    async def connect(cls, addr: str, token: str, timeout: float | None = 30.0,
                      max_inflight: int | None = None, tls: TlsOption = None,
                      same_host: bool | None = None,
                      insecure: bool | None = None) -> RpcContext:
        """``rpcbuf.connect``: every step within one ``timeout``, not one each."""
        try:
            async with asyncio.timeout(timeout):
                opened = await open_session(addr, token, timeout, tls, same_host, insecure)
                ctx = cls(opened.conn, opened.hello, opened.raw, timeout, max_inflight,
                          ucx_host=opened.host, handles=opened.handles)
                if not ctx.same_host:
                    try:  # bind now: a broken data path shows at connect, not at the first store
                        await ctx._paths.ucx.endpoint()
                    except BaseException:
                        opened.conn.close()
                        raise
                return ctx
        except TimeoutError:
            raise Timeout(f"connecting to {addr} took longer than {timeout}s") from None

    async def _call(self, req: P.Request, timeout: float | None = None) -> dict[str, Any]:
        return await self._caller.call(req, timeout)

    def _expired(self) -> None:
        self._conn.fail(ConnectionLost(f"a transfer took longer than {self.transfer_timeout}s"))
        self.abort()

    def _check_open(self) -> None:
        if self._closed:
            raise ConnectionLost("context is closed")
        if os.getpid() != self._pid:
            # After fork the daemon would copy from the parent's memory (same
            # addresses, other bytes), and UCX endpoints do not survive it.
            raise ConnectionLost("this context was opened by another process (before a "
                                 "fork): connect again in this one")
        if self._conn.lost is not None:
            raise self._conn.lost_error()

    async def __aenter__(self) -> RpcContext:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the session (idempotent). Session-scoped buffers are released."""
        if self._closed:
            return
        self._closed = True
        await self._paths.ucx.close()
        self._close_parts()

    def abort(self) -> None:
        """Close at once, waiting for nothing (idempotent): posted UCX
        requests fail, and the daemon ends the session as on ``close``."""
        self._closed = True
        self._paths.ucx.abort()
        self._close_parts()

    def _close_parts(self) -> None:
        self._conn.close()
        self._blocks.close()
        if self._own is not None:
            self._own.close()
        if self._handles is not None:
            self._handles.close()

    # -- control ops ----------------------------------------------------------------

    async def request_buffer(self, size: int, device_type: str = "CPU", device: int = 0,
                             timeout: float | None = None, ttl: float | None = None,
                             name: str | None = None) -> str:
        """Reserve ``size`` bytes; wait up to ``timeout`` s for memory.
        ``name`` makes a named buffer, ``ttl`` a leased one; either outlives the
        session, a buffer with neither ends with it.  Raises OUT_OF_MEMORY,
        QUOTA_EXCEEDED, UNSUPPORTED_DEVICE, BAD_REQUEST."""
        return await self._buffers.request_buffer(size, device_type, device, timeout, ttl, name)

    async def clone_buffer(self, src_id: str, name: str | None = None,
                           ttl: float | None = None) -> str:
        """A new buffer with ``src_id``'s size, bytes and manifest, sharing
        memory until either is written (copy on write, on the daemon).  Host
        buffers only.  Raises NOT_FOUND, OUT_OF_MEMORY, QUOTA_EXCEEDED,
        BAD_REQUEST (a name taken), UNSUPPORTED_DEVICE."""
        return await self._buffers.clone_buffer(src_id, name, ttl)

    async def get_buffer_meta(self, buffer_id: str, tensors: bool = True,
                              timeout: float | None = None) -> dict[str, Any]:
        """The buffer's metadata; ``tensors=False`` leaves out the manifest's
        entries.  Raises NOT_FOUND."""
        return await self._buffers.get_buffer_meta(buffer_id, tensors, timeout)

    def attach(self, buffer_id: str) -> Opening[Attachment]:
        """A zero-copy, read-only view of a buffer of ours on this node
        (``async with ctx.attach(buf) as view``).  While attached, writes to the
        buffer are BUSY.  Same host only.  Raises NOT_FOUND, BAD_REQUEST,
        UNSUPPORTED_DEVICE, QUOTA_EXCEEDED."""
        return Opening(lambda: self._attacher.attach(buffer_id))

    def map(self, buffer_id: str) -> Opening[MappedBuffer]:
        """A buffer of ours written in place: ``async with ctx.map(buf) as m``
        gives ``m.array`` over the daemon's memory.  While open, other sessions'
        ops on the buffer are BUSY.  Same host only (docs/dataplane.md).  Raises
        NOT_FOUND, BUSY, BAD_REQUEST, UNSUPPORTED_DEVICE, QUOTA_EXCEEDED."""
        own = self._own

        async def opened() -> MappedBuffer:
            self._check_open()
            if own is None:
                raise BadRequest("map needs the same-host path (a client on the daemon's "
                                 "host, on its Unix socket)", {"reason": "not_same_host"})
            return await own.map(buffer_id)
        return Opening(opened)

    def in_place_counts(self) -> dict[str, int]:
        """What this context did in place, which the daemon does not see:
        stores, reads, their bytes, grants and fallbacks."""
        own = self._own
        return dict(own.counts) if own is not None else {
            "stores": 0, "reads": 0, "bytes_stored": 0, "bytes_read": 0, "grants": 0,
            "fallbacks": 0}

    def attach_block(self, key: str) -> Opening[Attachment]:
        """A zero-copy, read-only view of a block on this node; never evicted
        while attached.  Same host only.  Raises NOT_FOUND (a miss), BAD_REQUEST,
        QUOTA_EXCEEDED."""
        return Opening(lambda: self._attacher.attach_block(key))

    async def release_buffer(self, buffer_id: str, timeout: float | None = None) -> None:
        """Raises NOT_FOUND."""
        await self._buffers.release_buffer(buffer_id, timeout)
        if self._own is not None:
            self._own.forget(buffer_id)

    async def renew_buffer(self, buffer_id: str, ttl: float | None = None,
                           timeout: float | None = None) -> float | None:
        """Extend the lease to ``ttl`` s from now (default: the buffer's own);
        return the new expiry (unix time, or None).  Raises NOT_FOUND,
        BAD_REQUEST."""
        return await self._buffers.renew_buffer(buffer_id, ttl, timeout)

    # ``timeout`` of a control op: seconds for the whole call, the wait for an
    # in-flight slot included (default: the context's); past it, TIMEOUT.

    async def list_devices(self, timeout: float | None = None) -> list[dict[str, Any]]:
        """The node's devices, a map each (``key``, ``device_type``, ``free``, ...)."""
        return await self._buffers.list_devices(timeout)

    async def list_buffers(self, timeout: float | None = None) -> list[dict[str, Any]]:
        """This tenant's buffers on the node, a metadata map each."""
        return await self._buffers.list_buffers(timeout)

    async def stats(self, timeout: float | None = None) -> dict[str, Any]:
        """This tenant's view of the node: sessions, buffers, counters, devices
        and ``limits``."""
        return await self._buffers.stats(timeout)

    async def ping(self, timeout: float | None = None) -> float:
        """Round trip to the daemon, in seconds. Raises TIMEOUT, CONNECTION_LOST."""
        return await self._buffers.ping(timeout)

    async def open_buffer(self, name: str, timeout: float | None = None) -> str:
        """The id of this tenant's buffer called ``name``. Raises NOT_FOUND."""
        return await self._buffers.open_buffer(name, timeout)

    async def clear_buffer(self, buffer_id: str, value: int = 0, offset: int = 0,
                           nbytes: int | None = None) -> None:
        """Set ``nbytes`` (default: to the end) from ``offset`` to ``value`` on
        the daemon.  Raises NOT_FOUND, OUT_OF_RANGE, BAD_REQUEST, BUSY."""
        await self._buffers.clear_buffer(buffer_id, value, offset, nbytes)

    async def copy_buffer(self, src_id: str, src_offset: int, dst_id: str, dst_offset: int,
                          nbytes: int) -> None:
        """Copy between this tenant's buffers on the node.  Raises NOT_FOUND,
        OUT_OF_RANGE, BUSY."""
        await self._buffers.copy_buffer(src_id, src_offset, dst_id, dst_offset, nbytes)

    # -- data ops -------------------------------------------------------------------

    async def store_tensor(self, buffer_id: str, array: Any, offset: int = 0, sync: bool = True,
                           verify: str | None = None, wire_dtype: str | None = None) -> Any:
        """Copy ``array``'s bytes (NumPy, torch, CuPy, buffer protocol, CUDA
        array interface or DLPack) into the buffer at ``offset``.
        ``verify="checksum"`` has the daemon compare checksums; ``wire_dtype="float16"``
        sends a float32 tensor as float16; ``sync=False`` returns a task (keep the
        array unchanged until it ends).  Raises NOT_FOUND, OUT_OF_RANGE,
        VERIFY_FAILED, BAD_REQUEST, BUSY, CONNECTION_LOST."""
        done = self._ranges.store_now(buffer_id, array, offset, sync, verify, wire_dtype)
        if done is not None:  # in place, at once (docs/dataplane.md "Writing in place")
            return done
        return await self._ranges.store_tensor(buffer_id, array, offset, sync, verify, wire_dtype)

    async def read_buffer(self, buffer_id: str, offset: int = 0, nbytes: int | None = None,
                          out: Any = None) -> np.ndarray:
        """Read ``nbytes`` (default: ``out``'s size, else to the end) into
        ``out`` or a new uint8 array, and return it.  Raises NOT_FOUND,
        OUT_OF_RANGE, BAD_REQUEST, CONNECTION_LOST."""
        done = self._ranges.read_now(buffer_id, offset, nbytes, out)
        if done is not None:  # in place, at once
            return done
        return await self._ranges.read_buffer(buffer_id, offset, nbytes, out)

    async def store_batch(self, buffer_id: str, items: Sequence[tuple[int, Any]],
                          verify: str | None = None,
                          manifest: tuple[list[str], list[str], list[list[int]]] | Packed
                          | None = None,
                          manifest_version: int | None = None,
                          checksums: Sequence[int] | None = None) -> dict[str, Any]:
        """Store many ``(offset, array)`` items of one buffer in one round trip.
        ``manifest`` (names, dtypes, shapes) is recorded; with ``manifest_version``
        a changed manifest is BAD_REQUEST (``manifest_changed``) before any byte
        lands.  ``checksums``: the items' xxh3-64, when known.  Host arrays only.
        Raises NOT_FOUND, OUT_OF_RANGE, VERIFY_FAILED, BAD_REQUEST, BUSY."""
        return await self._ranges.store_batch(buffer_id, items, verify, manifest,
                                              manifest_version, checksums)

    async def read_batch(self, buffer_id: str,
                         ranges: Sequence[tuple[int, int]]) -> list[np.ndarray]:
        """Read many ``(offset, nbytes)`` ranges in one round trip, as uint8
        arrays in the order asked.  Raises NOT_FOUND, OUT_OF_RANGE, BAD_REQUEST."""
        return await self._ranges.read_batch(buffer_id, ranges)

    # -- keyed blocks (blockops.py; the daemon's blocks.py, docs/kvcache.md) ------------

    async def put_blocks(self, blocks: Mapping[str, Any] | Sequence[tuple[str, Any]],
                         ttl: float | None = None, metas: Sequence[bytes] | None = None,
                         device_type: str = "CPU", device: int = 0) -> dict[str, Any]:
        """Store ``{key: array}`` as keyed blocks, all or nothing, in one round
        trip; a full tier evicts this tenant's least recently used blocks.
        ``ttl``: seconds each lives; ``metas``: a blob (<= 1 KiB) per block.
        Raises BAD_REQUEST, VERIFY_FAILED, QUOTA_EXCEEDED, OUT_OF_MEMORY,
        UNSUPPORTED_DEVICE."""
        return await self._blocks.put(blocks, ttl, metas, device_type, device)

    async def put_block(self, key: str, array: Any, ttl: float | None = None,
                        meta: bytes | None = None) -> dict[str, Any]:
        """``put_blocks`` of one block."""
        return await self.put_blocks([(key, array)], ttl, None if meta is None else [meta])

    async def get_blocks(self, keys: Sequence[str], out: Sequence[Any],
                         strict: bool = False) -> list[bool]:
        """Read blocks into ``out`` (host arrays, each its block's size); return
        which keys were read.  A size mismatch counts as missing, or with
        ``strict`` is BAD_REQUEST (``size_mismatch``).  Raises BAD_REQUEST."""
        return await self._blocks.get(keys, out, strict)

    async def get_block(self, key: str, out: Any = None,
                        max_nbytes: int = MAX_BLOCK_NBYTES) -> np.ndarray | None:
        """One block as a uint8 array (into ``out`` when given), or None; one
        bigger than ``max_nbytes`` is BAD_REQUEST (``too_big``)."""
        return await self._blocks.get_one(key, out, max_nbytes)

    async def lookup_blocks(self, keys: Sequence[str], meta: bool = False,
                            timeout: float | None = None) -> list[dict[str, Any] | None]:
        """Per key: None, or ``{"nbytes"}`` (with ``meta``: ``"meta"``,
        ``"expires_at"``).  A lookup counts as a use."""
        return await self._blocks.lookup(keys, meta, timeout)

    async def blocks_exist(self, keys: Sequence[str],
                           timeout: float | None = None) -> list[bool]:
        """Per key, whether it names a block (``lookup_blocks``: a use too)."""
        return await self._blocks.exist(keys, timeout)

    async def remove_blocks(self, keys: Sequence[str], timeout: float | None = None) -> int:
        """Remove blocks by key; return how many keys named one."""
        return await self._blocks.remove(keys, timeout)

    async def list_blocks(self, prefix: str | None = None, start_after: str | None = None,
                          limit: int = 1000, timeout: float | None = None
                          ) -> tuple[list[str], bool]:
        """This tenant's keys, sorted: at most ``limit`` (1..4096) after
        ``start_after`` that start with ``prefix``; and whether more follow."""
        return await self._blocks.list(prefix, start_after, limit, timeout)

    # -- named tensors (tensorops.py) and dedup uploads (dedup.py) ---------------------

    async def store_tensors(self, buffer_id: str, tensors: Mapping[str, Any],
                            offset: int | None = None,
                            verify: str | None = None,
                            sources: Mapping[str, Source] | None = None) -> ManifestTable:
        """Store ``{name: array}`` at aligned offsets and record the manifest;
        return the entries written.  Without ``offset`` a name stored with the
        same size is overwritten in place.  ``sources``: name -> (source type,
        logical shape).  Host arrays only.  Raises NOT_FOUND, OUT_OF_RANGE,
        VERIFY_FAILED, BAD_REQUEST, BUSY."""
        return await self._tensors.store_tensors(buffer_id, tensors, offset, verify, sources)

    async def load_tensors(self, buffer_id: str, names: Iterable[str] | None = None,
                           verify: bool = True, framework: str = "numpy") -> dict[str, Any]:
        """``{name: array}`` with the stored dtype and shape, in one batch
        (``framework="torch"``: torch tensors, no copy).  Raises NOT_FOUND,
        VERIFY_FAILED, BAD_REQUEST."""
        return await self._tensors.load_tensors(buffer_id, names, verify, framework)

    async def store_tensors_dedup(self, buffer_id: str, tensors: Mapping[str, Any],
                                  offsets: Mapping[str, int] | None = None,
                                  verify: str | None = "checksum",
                                  hashes: Mapping[str, tuple[int, int]] | None = None,
                                  sources: Mapping[str, Source] | None = None,
                                  ) -> dict[str, Any]:
        """``store_tensors``, sending only the contents this tenant does not
        hold on the node already.  ``hashes``: name -> (xxh3-128, xxh3-64), when
        known.  Raises NOT_FOUND, OUT_OF_RANGE, VERIFY_FAILED, BAD_REQUEST, BUSY."""
        return await self._dedup.store_tensors_dedup(buffer_id, tensors, offsets, verify, hashes,
                                                     sources)

    async def load_file(self, buffer_id: str, path: str, file_size: int,
                        tensors: Sequence[fileload.FileTensor],
                        timeout: float | None = None) -> dict[str, Any]:
        """Have the node read ``tensors`` of ``path`` in its ``--model-dir``
        straight into the buffer, each verified before the manifest records it.
        Raises FORBIDDEN, NOT_FOUND, VERIFY_FAILED, OUT_OF_RANGE, BUSY, TIMEOUT,
        BAD_REQUEST."""
        self._check_open()
        req = fileload.request(buffer_id, path, file_size, tensors)
        result = await self._call(req, self.transfer_timeout if timeout is None else timeout)
        self._tensors.manifests.pop(buffer_id, None)  # the manifest changed on the node
        return result

    async def verify_write(self, buffer_id: str, offset: int, array: Any) -> bool:
        """Read the range back and compare it with ``array``: True, or
        VERIFY_FAILED."""
        return await self._ranges.verify_write(buffer_id, offset, array)


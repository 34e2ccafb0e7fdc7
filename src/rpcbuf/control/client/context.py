"""The async client's verbs: ``RpcContext``, a session with one rpcbufd.

A context is composed of parts, each in its own module: the control
connection and its in-flight slots (``connection.py``: ``ControlConnection``,
``Caller``), the session's data paths and the one rule that picks one per op
(``datapath.py``), the quick control ops (``bufferops.py``), the byte-range
verbs and what the daemon stated about each buffer (``rangeops.py``:
``RangeOps``, and ``Places``, which routes and checks every data op), the
batch planning (``batches.py``), the keyed block tier (``blockops.py``), the
named-tensor layer with its manifest cache (``tensorops.py``), the dedup
upload (``dedup.py``) and the attach verbs (``attach.py``).  ``opening.py``
opens the session (TCP or Unix socket, hello, the same-host switch) before
any of them exists.  What this module adds is the verbs themselves (their
names, defaults and docstrings are the contract; a verb with a part hands
the call to it in one line) and the session's life: connect, close, abort
and the check every verb makes first.

Many tasks may share one context: every call gets its own request id, a
semaphore sized by the daemon's ``max_inflight`` gives back-pressure, and
every wait of a call is inside the call's timeout.  When the daemon goes
away every pending call fails with ``CONNECTION_LOST``; none hangs.
Answers are parsed once, at the edge (``answers.py``, ``hello.py``); the
public methods still return the wire dicts they always returned.
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
        """``rpcbuf.connect``: every step (TCP, hello, the same-host switch,
        the UCX bind) within one ``timeout``, not one each."""
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
        self._conn.close()
        self._blocks.close()
        if self._own is not None:
            self._own.close()
        if self._handles is not None:
            self._handles.close()

    def abort(self) -> None:
        """Close at once, waiting for nothing (idempotent): posted UCX
        requests fail, and the daemon ends the session as on ``close``."""
        self._closed = True
        self._paths.ucx.abort()
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

        ``name`` makes a named buffer (``open_buffer`` finds it), ``ttl`` a
        leased one (released ``ttl`` s after it was made or last renewed);
        either outlives this session, a buffer with neither ends with it.
        Raises OUT_OF_MEMORY (details: requested, free, largest_free),
        QUOTA_EXCEEDED, UNSUPPORTED_DEVICE, BAD_REQUEST."""
        return await self._buffers.request_buffer(size, device_type, device, timeout, ttl, name)

    async def clone_buffer(self, src_id: str, name: str | None = None,
                           ttl: float | None = None) -> str:
        """A new buffer on the same node with ``src_id``'s size, bytes and
        manifest, made without copying: the two share memory until either is
        written (that write first copies the buffer, on the daemon; a write
        that cannot get the memory for the copy is OUT_OF_MEMORY, reason
        ``backing``). Named, leased or, with neither, session-scoped, like
        ``request_buffer``. Host buffers only. Raises NOT_FOUND, OUT_OF_MEMORY
        (no waiting), QUOTA_EXCEEDED, BAD_REQUEST (a name taken),
        UNSUPPORTED_DEVICE."""
        return await self._buffers.clone_buffer(src_id, name, ttl)

    async def get_buffer_meta(self, buffer_id: str, tensors: bool = True,
                              timeout: float | None = None) -> dict[str, Any]:
        """The buffer's metadata; ``tensors=False`` leaves out the manifest's
        entries (a big manifest is a big answer). Raises NOT_FOUND."""
        return await self._buffers.get_buffer_meta(buffer_id, tensors, timeout)

    def attach(self, buffer_id: str) -> Opening[Attachment]:
        """A zero-copy, read-only view of a buffer of ours on this node:
        ``async with ctx.attach(buf) as view`` (or ``view = await
        ctx.attach(buf)`` and later ``await view.close()``); ``view.tensors()``
        and ``view.array(offset, nbytes)`` are arrays over the daemon's
        memory: NumPy for a host buffer, CuPy for a GPU buffer with CUDA VMM
        handles (imported read-only).  While attached, stores, clears and
        copies into the buffer are BUSY, and a release frees its memory only
        at the last detach (see ``control/client/attach.py``).  Needs the
        same-host path.  Raises NOT_FOUND, BAD_REQUEST (not same-host),
        UNSUPPORTED_DEVICE (a GPU buffer without VMM handles),
        QUOTA_EXCEEDED (too many attachments in this session)."""
        return Opening(lambda: self._attacher.attach(buffer_id))

    def map(self, buffer_id: str) -> Opening[MappedBuffer]:
        """A buffer of ours written in place: ``async with ctx.map(buf) as m``
        gives ``m.array``, a writable uint8 array over the daemon's memory of
        the buffer (same host; a CuPy array for a GPU buffer on a CUDA VMM
        arena).  No copy and no round trip per
        write; while it is open, other sessions' ops on the buffer (attach,
        read, store, copy) are BUSY, and the buffer leaves the content index
        for good.  A release ends it; the pages
        stay this process's (charged to the tenant until the session ends),
        never another buffer's.  See docs/dataplane.md ("Writing in place").
        Raises NOT_FOUND, BUSY (attached, or mapped by another session),
        BAD_REQUEST (not same-host), UNSUPPORTED_DEVICE (a GPU buffer
        without VMM handles), QUOTA_EXCEEDED (too many mapped in this session)."""
        own = self._own

        async def opened() -> MappedBuffer:
            self._check_open()
            if own is None:
                raise BadRequest("map needs the same-host path (a client on the daemon's "
                                 "host, on its Unix socket)", {"reason": "not_same_host"})
            return await own.map(buffer_id)
        return Opening(opened)

    def in_place_counts(self) -> dict[str, int]:
        """What this context did in place (``store_tensor``/``read_buffer``
        into and out of its own mappings, which the daemon does not see):
        stores, reads, their bytes, grants asked for, and ops that went the
        daemon's way instead (fallbacks).  All zero without the same-host path."""
        own = self._own
        return dict(own.counts) if own is not None else {
            "stores": 0, "reads": 0, "bytes_stored": 0, "bytes_read": 0, "grants": 0,
            "fallbacks": 0}

    def attach_block(self, key: str) -> Opening[Attachment]:
        """A block served in place: a zero-copy, read-only view of it on this
        node (same host only), ``async with ctx.attach_block(key) as view``;
        ``view.array()`` is its bytes (``view.size`` of them).  While
        attached the block is never evicted, and a remove, a replace or its
        ttl takes it out of the tier at once but frees its
        memory only when the view closes.  Raises NOT_FOUND (a miss),
        BAD_REQUEST (not same-host), QUOTA_EXCEEDED (too many attachments in
        this session)."""
        return Opening(lambda: self._attacher.attach_block(key))

    async def release_buffer(self, buffer_id: str, timeout: float | None = None) -> None:
        """Raises NOT_FOUND."""
        await self._buffers.release_buffer(buffer_id, timeout)
        if self._own is not None:
            self._own.forget(buffer_id)

    async def renew_buffer(self, buffer_id: str, ttl: float | None = None,
                           timeout: float | None = None) -> float | None:
        """Extend the lease to ``ttl`` s from now (default: the buffer's own
        ttl; a ``ttl`` gives a buffer without a lease one, which outlives the
        session); return the new expiry (unix time; None: the buffer has no
        lease). Raises NOT_FOUND, BAD_REQUEST (a ttl that is not positive)."""
        return await self._buffers.renew_buffer(buffer_id, ttl, timeout)

    # ``timeout`` of a control op: seconds for the whole call, the wait for an
    # in-flight slot included (default: the context's); past it, TIMEOUT.

    async def list_devices(self, timeout: float | None = None) -> list[dict[str, Any]]:
        """The node's devices, a map each (``key``, ``device_type``, ``device``,
        ``total``, ``free``, ``largest_free``, ...)."""
        return await self._buffers.list_devices(timeout)

    async def list_buffers(self, timeout: float | None = None) -> list[dict[str, Any]]:
        """This tenant's buffers on the node (not its blocks), a metadata map each."""
        return await self._buffers.list_buffers(timeout)

    async def stats(self, timeout: float | None = None) -> dict[str, Any]:
        """What this tenant may see of the node: its sessions, buffers, bytes
        and counters, each device's size and free bytes, and ``limits``:
        what it holds of each bounded resource and the limit of each."""
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
        the daemon (no bytes cross the network).  Raises NOT_FOUND,
        OUT_OF_RANGE, BAD_REQUEST, BUSY (the buffer is attached)."""
        await self._buffers.clear_buffer(buffer_id, value, offset, nbytes)

    async def copy_buffer(self, src_id: str, src_offset: int, dst_id: str, dst_offset: int,
                          nbytes: int) -> None:
        """Copy between (or within) this tenant's buffers on the daemon's node,
        without moving bytes over the network. Raises NOT_FOUND, OUT_OF_RANGE,
        BUSY (the destination is attached)."""
        await self._buffers.copy_buffer(src_id, src_offset, dst_id, dst_offset, nbytes)

    # -- data ops -------------------------------------------------------------------

    async def store_tensor(self, buffer_id: str, array: Any, offset: int = 0, sync: bool = True,
                           verify: str | None = None, wire_dtype: str | None = None) -> Any:
        """Copy ``array``'s bytes into the buffer at ``offset``: a host array
        into a host buffer goes through the session's staging area on the
        same-host path (we copy it in, the daemon copies it out) and, from a
        network session, rides in the request frame when it is small;
        everything else travels over UCX.

        ``array``: NumPy, PyTorch (CPU or CUDA), CuPy, or anything with the
        buffer protocol, ``__cuda_array_interface__`` or DLPack; a contiguous
        one is used where it lies (no copy beside the path's own), a
        non-contiguous one is copied once first (see
        ``control/client/arrays.py``).
        ``verify="checksum"`` has the daemon hash what it received and compare
        (the checksum the daemon states for the buffer's device: xxh3 on the
        host, ``devsum`` on a GPU; ``devsum`` too for an array in GPU memory,
        see docs/gpu.md).  ``wire_dtype="float16"`` sends a float32 tensor as
        float16 (half the bytes); the daemon widens it back into float32.
        ``sync=False`` returns a task at once (await it for the answer; keep
        the array unchanged until then).  Raises NOT_FOUND, OUT_OF_RANGE,
        VERIFY_FAILED, BAD_REQUEST, BUSY (the buffer is attached),
        CONNECTION_LOST."""
        done = self._ranges.store_now(buffer_id, array, offset, sync, verify, wire_dtype)
        if done is not None:  # in place, at once (docs/dataplane.md "Writing in place")
            return done
        return await self._ranges.store_tensor(buffer_id, array, offset, sync, verify, wire_dtype)

    async def read_buffer(self, buffer_id: str, offset: int = 0, nbytes: int | None = None,
                          out: Any = None) -> np.ndarray:
        """Read ``nbytes`` (default: ``out``'s size, else to the buffer's end)
        straight into ``out`` (or a new uint8 array), which is returned.

        Raises NOT_FOUND, OUT_OF_RANGE, BAD_REQUEST, CONNECTION_LOST."""
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
        """Store many ``(offset, array)`` items of one buffer in one control
        round trip: on the same-host path they are copied through the
        session's staging area, over UCX touching items travel as one
        message per run; either way they land straight in their slices.
        ``manifest`` = (names, dtypes, shapes), index-aligned with
        ``items``, is recorded on the daemon;
        with ``manifest_version`` the daemon refuses (BAD_REQUEST, reason
        ``manifest_changed``, before any byte lands) if the manifest changed.
        With ``verify="checksum"``, ``checksums`` (index-aligned with
        ``items``) are the items' xxh3-64 when the caller has them already,
        so they are not computed again here; the daemon compares them with
        what it received all the same (a wrong one is VERIFY_FAILED).
        The answer's ``checksums`` (with a manifest) are index-aligned with
        ``items`` too; they are xxh3-64, whatever the buffer's device.
        Host arrays only (BAD_REQUEST for GPU memory: use ``store_tensor``).
        Raises NOT_FOUND, OUT_OF_RANGE, VERIFY_FAILED, BAD_REQUEST, BUSY (the
        buffer is attached)."""
        return await self._ranges.store_batch(buffer_id, items, verify, manifest,
                                              manifest_version, checksums)

    async def read_batch(self, buffer_id: str,
                         ranges: Sequence[tuple[int, int]]) -> list[np.ndarray]:
        """Read many ``(offset, nbytes)`` ranges of one buffer in one round
        trip; returns uint8 arrays in the order asked.  Ranges close together
        are read as one span (``tensors.plan_spans``) and come back as views
        into it.  Raises NOT_FOUND, OUT_OF_RANGE, BAD_REQUEST."""
        return await self._ranges.read_batch(buffer_id, ranges)

    # -- keyed blocks (blockops.py; the daemon's blocks.py, docs/kvcache.md) ------------

    async def put_blocks(self, blocks: Mapping[str, Any] | Sequence[tuple[str, Any]],
                         ttl: float | None = None, metas: Sequence[bytes] | None = None,
                         device_type: str = "CPU", device: int = 0) -> dict[str, Any]:
        """Store ``{key: array}`` (or ``(key, array)`` pairs) as keyed blocks of
        this tenant, in one round trip, straight from the arrays.  All or
        nothing: a reader sees none of them until every byte landed and
        matched its xxh3-64; then each replaces what its key named.  A full
        tier evicts this tenant's least recently used blocks to make room.
        ``ttl``: seconds each block lives (None: until evicted or removed);
        ``metas``: a small blob per block (at most 1 KiB), given back by
        ``lookup_blocks(meta=True)``.  Raises BAD_REQUEST, VERIFY_FAILED,
        QUOTA_EXCEEDED (larger than the quota, or nothing left to evict),
        OUT_OF_MEMORY, UNSUPPORTED_DEVICE."""
        return await self._blocks.put(blocks, ttl, metas, device_type, device)

    async def put_block(self, key: str, array: Any, ttl: float | None = None,
                        meta: bytes | None = None) -> dict[str, Any]:
        """``put_blocks`` of one block."""
        return await self.put_blocks([(key, array)], ttl, None if meta is None else [meta])

    async def get_blocks(self, keys: Sequence[str], out: Sequence[Any],
                         strict: bool = False) -> list[bool]:
        """Read blocks straight into ``out`` (index-aligned with ``keys``:
        host arrays, contiguous and writable, each exactly its block's size),
        in one round trip when all are there; returns which keys were read
        (the others' arrays are left as they were, or hold arbitrary bytes
        when a block went away between tries).  A key whose block is there
        but of another size than its array counts as missing, with a debug
        line on the ``rpcbuf.client`` logger; with ``strict=True`` it raises
        BAD_REQUEST (``details["reason"] == "size_mismatch"``, with the key
        and both sizes) instead.  Raises BAD_REQUEST."""
        return await self._blocks.get(keys, out, strict)

    async def get_block(self, key: str, out: Any = None,
                        max_nbytes: int = MAX_BLOCK_NBYTES) -> np.ndarray | None:
        """One block as a uint8 array (into ``out`` when given), or None.
        Without ``out`` the array is as big as the daemon says the block
        is, at most ``max_nbytes`` (1 GiB): a bigger one is BAD_REQUEST
        (reason ``too_big``) before anything is allocated."""
        return await self._blocks.get_one(key, out, max_nbytes)

    async def lookup_blocks(self, keys: Sequence[str], meta: bool = False,
                            timeout: float | None = None) -> list[dict[str, Any] | None]:
        """Per key: None when it names no block, else ``{"nbytes"}`` (and
        with ``meta``, ``"meta"`` and ``"expires_at"``, unix time or None).
        A lookup counts as a use for the LRU order."""
        return await self._blocks.lookup(keys, meta, timeout)

    async def blocks_exist(self, keys: Sequence[str],
                           timeout: float | None = None) -> list[bool]:
        """Per key, whether it names a block (``lookup_blocks``: a use too)."""
        return await self._blocks.exist(keys, timeout)

    async def remove_blocks(self, keys: Sequence[str], timeout: float | None = None) -> int:
        """Remove blocks by key (a block being read is freed when the read
        ends); returns how many keys named one."""
        return await self._blocks.remove(keys, timeout)

    async def list_blocks(self, prefix: str | None = None, start_after: str | None = None,
                          limit: int = 1000, timeout: float | None = None
                          ) -> tuple[list[str], bool]:
        """This tenant's keys, sorted: at most ``limit`` (1..4096) after
        ``start_after``, those starting with ``prefix``; and whether more follow."""
        return await self._blocks.list(prefix, start_after, limit, timeout)

    # -- named tensors (tensorops.py) and dedup uploads (dedup.py) ---------------------

    async def store_tensors(self, buffer_id: str, tensors: Mapping[str, Any],
                            offset: int | None = None,
                            verify: str | None = None,
                            sources: Mapping[str, Source] | None = None) -> ManifestTable:
        """Store ``{name: array}`` at aligned offsets and record the manifest.

        Returns the manifest entries written (a read-only mapping name ->
        offset, nbytes, dtype, shape, checksum).
        Without ``offset``, names already stored with the same size are
        overwritten in place and the others go after the last slot in use;
        with it, every tensor gets a new slot from ``offset`` on.  Two
        clients storing into one buffer at once should use distinct
        ``offset``s.  Host arrays only (GPU tensors: ``store_tensor``).
        ``sources`` (name -> (source type, logical shape), either None) adds
        what a tensor is beyond its NumPy view to its entry (``source_type``,
        ``logical_shape``; e.g. ``("Q8_0", (512, 256))`` for uint8 rows of
        shape (512, 272)); a daemon before protocol 3 records neither.
        Raises NOT_FOUND, OUT_OF_RANGE (the buffer is too small: size it with
        ``calculate_buffer_size``), VERIFY_FAILED, BAD_REQUEST (also for a
        source type that is not 1-32 of [A-Za-z0-9_] or a logical shape of
        more than 32 dimensions, and for an array in GPU memory), BUSY (the
        buffer is attached)."""
        return await self._tensors.store_tensors(buffer_id, tensors, offset, verify, sources)

    async def load_tensors(self, buffer_id: str, names: Iterable[str] | None = None,
                           verify: bool = True, framework: str = "numpy") -> dict[str, Any]:
        """``{name: array}`` with the stored dtype and shape, in one batch:
        of ``names``, or of every tensor but the model loader's own entries
        (``__rpcbuf_metadata__``, ``__rpcbuf_load__``: given when named).

        With ``verify`` each tensor's xxh3 is compared with the manifest.
        ``framework="torch"`` gives torch tensors over the same memory (no
        copy), each of the dtype it was stored with: a bfloat16 or float8
        tensor, which NumPy has no dtype for, is its bits in the NumPy form
        (``uint16``/``uint8``, the entry's ``source_type`` says ``BF16``...).
        Raises NOT_FOUND (buffer, or a name not in its manifest), VERIFY_FAILED,
        BAD_REQUEST (an unknown framework, or torch not installed)."""
        return await self._tensors.load_tensors(buffer_id, names, verify, framework)

    async def store_tensors_dedup(self, buffer_id: str, tensors: Mapping[str, Any],
                                  offsets: Mapping[str, int] | None = None,
                                  verify: str | None = "checksum",
                                  hashes: Mapping[str, tuple[int, int]] | None = None,
                                  sources: Mapping[str, Source] | None = None,
                                  ) -> dict[str, Any]:
        """Store ``{name: array}`` like ``store_tensors``, sending only the
        tensors whose contents this tenant does not hold on that node already.

        ``offsets`` (name -> offset) places the tensors; by default they go
        where ``store_tensors`` would put them; ``sources`` as in
        ``store_tensors``; ``hashes`` (name -> (xxh3-128, xxh3-64) of its
        bytes) spares hashing them here when the caller has them already.
        Returns ``{"tensors", "placed", "sent", "bytes_placed",
        "bytes_sent"}``.  Raises NOT_FOUND, OUT_OF_RANGE, VERIFY_FAILED,
        BAD_REQUEST, BUSY (the buffer is attached)."""
        return await self._dedup.store_tensors_dedup(buffer_id, tensors, offsets, verify, hashes,
                                                     sources)

    async def load_file(self, buffer_id: str, path: str, file_size: int,
                        tensors: Sequence[fileload.FileTensor],
                        timeout: float | None = None) -> dict[str, Any]:
        """Have the node read ``tensors`` of the file ``path`` in its own
        ``--model-dir`` straight into the buffer (node-local load; nothing
        moves over the network).  Each tensor is verified against its
        ``digest`` (xxh3-128) and ``checksum`` (xxh3-64) before any is recorded
        in the manifest (with its ``source_type`` and ``logical_shape``, where
        given).  ``timeout`` defaults to the daemon's transfer
        deadline.  Returns ``{"nbytes", "items", "read", "in_place",
        "manifest_version"}`` (``read``: bytes read from the node's disk;
        ``in_place``: tensors already there, verified, not read again).
        Raises FORBIDDEN (a node without ``--model-dir``, a path outside it),
        NOT_FOUND (the buffer, the file), VERIFY_FAILED (the node's copy
        differs: its size, a tensor's place or hash; the message names the
        file and the tensor), OUT_OF_RANGE, BUSY (the buffer is attached),
        TIMEOUT, BAD_REQUEST."""
        self._check_open()
        req = fileload.request(buffer_id, path, file_size, tensors)
        result = await self._call(req, self.transfer_timeout if timeout is None else timeout)
        self._tensors.manifests.pop(buffer_id, None)  # the manifest changed on the node
        return result

    async def verify_write(self, buffer_id: str, offset: int, array: Any) -> bool:
        """Read the range back over the data plane and compare it with ``array``.

        Returns True when equal; raises VERIFY_FAILED (with the first differing
        byte) when not."""
        return await self._ranges.verify_write(buffer_id, offset, array)


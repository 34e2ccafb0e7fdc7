"""The async client: a control connection plus a data path.

The data path is a UCX endpoint bound to the session, or, for a client on the
daemon's host, the *same-host path*: the client reconnects on the daemon's
Unix socket (named in ``hello``), proves the daemon can read its memory, and
from then on sends the addresses of its host arrays instead of their bytes;
the daemon copies between them and the arena (``dataplane/cma.py``).  Arrays
the daemon may touch stay referenced (``ControlConnection.hold``) until the
daemon answers, even if the caller stopped waiting.  GPU arrays and GPU
buffers always use UCX (bound on first use on a same-host session).

Layers: byte stream -> ``ControlConnection`` (an asyncio protocol: frames, request ids, pending
futures) -> ``RpcContext`` (the public API).  The UCX ``DataEndpoint`` sits
beside the control connection, not inside it.  Many tasks may share one
context: every call gets its own request id, answers are matched by id, and a
semaphore sized by the daemon's ``max_inflight`` gives back-pressure instead
of unbounded queues.  When the daemon goes away every pending call fails with
``CONNECTION_LOST``; none hangs: transfers in flight stop being waited for
at once (``ucx.transfer_all``'s ``abandon``), whatever state UCX has them in.

The daemon is not trusted blindly either (it may be malicious, or an
impostor on its Unix socket): its ``hello`` is checked field by field
(``hello.py``) before the semaphore, deadlines or sockets are sized from it,
every wait of a call (an in-flight slot included) is inside the call's
timeout, and the peer of a Unix socket is checked (``check_unix_peer``)
before the token is sent on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import operator
import os
import socket
import ssl
import struct
from collections.abc import Awaitable, Callable, Generator, Sequence
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from control.client.arrays import (
    as_bytes,
    data_addresses,
    dtype_name,
    is_cuda,
    populate,
    prepare,
    to_wire_f16,
)
from control.client.dedup import DedupClientOps
from control.client.hello import check_hello
from control.client.tensors import (
    XXH3,
    Items,
    Packed,
    TensorOps,
    bulk_views,
    in_caller_order,
    offset_order,
    plan_spans,
)
from control.wire import protocol as P
from control.wire.errors import (
    AuthFailed,
    BadRequest,
    ConnectionLost,
    Forbidden,
    RpcBufError,
    Timeout,
    TokenExpired,
    VerifyFailed,
    error_from_wire,
)
from control.wire.gpuops import check_wire_dtype
from control.wire.runs import plan_runs, run_tag
from control.wire.units import split_host_port
from dataplane import cma, ucx
from dataplane.checksum import checksum
from dataplane.devsum import devsum

DEFAULT_PORT = 7700
ORPHAN_GRACE = 60.0  # s, at least: arrays of a lost same-host session stay referenced
_ORPHANS: list[Any] = []  # see ControlConnection._fail_all
log = logging.getLogger("rpcbuf.client")


def same_host_default() -> bool | None:
    """``RPCBUF_SAME_HOST``: 0 = never, 1 = required, unset/auto = when possible."""
    value = os.environ.get("RPCBUF_SAME_HOST", "auto").strip().lower()
    if value in ("0", "false", "no", "off", "never"):
        return False
    if value in ("1", "true", "yes", "on", "always"):
        return True
    return None


def parse_addr(addr: str) -> tuple[str, int]:
    try:
        return split_host_port(addr, DEFAULT_PORT)
    except ValueError:
        raise BadRequest(f"bad address {addr!r}: want HOST:PORT") from None


class ControlConnection(asyncio.Protocol):
    """The control connection as a protocol: answers are decoded and their
    futures resolved in ``data_received`` itself (no reader task, so one
    event-loop wake-up less per answer than with streams)."""

    def __init__(self, max_frame: int = P.DEFAULT_MAX_FRAME) -> None:
        self.on_lost: Callable[[], None] | None = None  # e.g. abort the UCX endpoint
        self._transport: Any = None  # an asyncio (or uvloop) transport
        self._decoder = P.FrameDecoder(max_frame)
        self._max_frame = max_frame
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._held: dict[int, Any] = {}  # request id -> arrays the daemon may copy into/from
        self.orphan_grace = ORPHAN_GRACE  # RpcContext: at least the daemon's transfer deadline
        self._ids = itertools.count(1)
        self._lost: RpcBufError | None = None
        self._lost_fut: asyncio.Future[None] | None = None

    @property
    def lost(self) -> RpcBufError | None:
        return self._lost

    def lost_future(self) -> asyncio.Future[None]:
        """Done once the connection is lost: what every wait on the data
        plane races against (``ucx.transfer_all``'s ``abandon``)."""
        if self._lost_fut is None:
            self._lost_fut = asyncio.get_running_loop().create_future()
            if self._lost is not None:
                self._lost_fut.set_result(None)
        return self._lost_fut

    def orphan(self, arrays: Any) -> None:
        """Keep ``arrays`` referenced for ``orphan_grace``: the daemon (same
        host) or UCX may still touch them after we stopped waiting."""
        _ORPHANS.append(arrays)
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().call_later(self.orphan_grace, _ORPHANS.remove, arrays)

    def next_id(self) -> int:
        return next(self._ids)

    def lost_error(self) -> RpcBufError:
        """What a call on the lost connection fails with: CONNECTION_LOST, or
        the daemon's own reason when it ended the session over its token
        (TOKEN_EXPIRED, AUTH_FAILED: a revoked key), whose cure is a new token,
        not a retry."""
        err = self._lost if self._lost is not None else ConnectionLost("connection closed")
        if isinstance(err, (TokenExpired, AuthFailed)):
            return type(err)(err.message, err.details)
        return ConnectionLost(err.message, {"cause": err.code})

    def submit(self, req_id: int, req: P.Request) -> asyncio.Future[dict[str, Any]]:
        """Send one request; the future resolves with the answer message."""
        if self._lost is not None:
            raise self.lost_error()
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        assert self._transport is not None
        try:
            self._transport.write(P.encode_frame(req.to_wire(req_id), self._max_frame))
        except P.FrameError as exc:
            raise BadRequest(str(exc)) from exc
        self._pending[req_id] = fut
        return fut

    def forget(self, req_id: int) -> None:
        self._pending.pop(req_id, None)

    def hold(self, req_id: int, arrays: Any) -> None:
        """Keep ``arrays`` alive until request ``req_id`` is answered: the
        daemon copies into or out of them until then (same-host path)."""
        self._held[req_id] = arrays

    # -- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            for msg in self._decoder.feed(data):
                self._deliver(msg)
            if self._decoder.error is not None:
                raise self._decoder.error
        except P.FrameError as exc:
            self._fail_all(ConnectionLost(f"daemon sent a bad frame: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail_all(ConnectionLost("connection closed by the daemon" if exc is None
                                      else f"connection lost: {exc}"))

    def _deliver(self, msg: dict[str, Any]) -> None:
        req_id = msg.get("id")
        if req_id is None:  # a connection-level error: the daemon is closing us
            self._fail_all(error_from_wire(msg.get("error")))
            self.close()  # the daemon waits for us to go
            return
        fut = self._pending.pop(req_id, None) if isinstance(req_id, int) else None
        if self._held and isinstance(req_id, int):
            self._held.pop(req_id, None)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    def fail(self, exc: RpcBufError) -> None:
        """Fail every pending call with ``exc`` and refuse new ones."""
        self._fail_all(exc)

    def _fail_all(self, exc: RpcBufError) -> None:
        if self._lost is None:
            self._lost = exc
        if self.on_lost is not None:
            self.on_lost()
        if self._lost_fut is not None and not self._lost_fut.done():
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                self._lost_fut.set_result(None)
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(self.lost_error())
        self._pending.clear()
        if self._held:
            # The daemon stops copying within moments of losing the session, but
            # we cannot hear when: keep the arrays alive a while before freeing.
            held = list(self._held.values())
            self._held.clear()
            self.orphan(held)

    def close(self) -> None:
        self._fail_all(ConnectionLost("connection closed"))
        if self._transport is not None:
            self._transport.close()


def _expire(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


def _result(msg: dict[str, Any]) -> dict[str, Any]:
    if msg.get("ok"):
        result = msg.get("result")
        return result if isinstance(result, dict) else {}
    raise error_from_wire(msg.get("error"))


class RpcContext(TensorOps, DedupClientOps):
    """A session with one rpcbufd: see ``rpcbuf.connect``."""

    def __init__(self, conn: ControlConnection, ep: ucx.DataEndpoint | None,
                 hello: dict[str, Any], timeout: float | None, max_inflight: int | None = None,
                 ucx_host: str = "127.0.0.1") -> None:
        self._conn = conn
        self._ep = ep  # None until first needed on a same-host session
        self._ucx_host = ucx_host
        self._ep_lock = asyncio.Lock()
        self.hello = hello
        #: True when this context's host arrays move by the same-host path
        self.same_host: bool = bool(hello.get("same_host"))
        self.session_id: str = hello["session_id"]
        self.tenant: str = hello["tenant"]
        self.node_id: str = hello["node_id"]
        self.timeout = timeout
        limit = int(hello["limits"]["max_inflight"])  # checked: 1 .. hello.MAX_INFLIGHT
        self.max_inflight = limit if max_inflight is None else max(1, min(max_inflight, limit))
        self._slots = asyncio.Semaphore(self.max_inflight)
        self.transfer_timeout = float(hello["limits"]["transfer_timeout"]) + 5.0
        # A copy the daemon had started when we went away ends by its deadline.
        conn.orphan_grace = max(ORPHAN_GRACE, self.transfer_timeout)
        self._closed = False
        self._pid = os.getpid()  # a context belongs to the process that opened it
        self._manifests: dict[str, Any] = {}  # buffer id -> cached manifest (tensors.py)
        self._gpu_buffers: set[str] = set()  # ids seen to be GPU buffers: verified with devsum
        # Without its control session the daemon drops the data endpoint too:
        # abort ours at once so posted UCX requests fail instead of waiting.
        conn.on_lost = self._abort_ep

    def _abort_ep(self) -> None:
        if self._ep is not None:
            self._ep.abort()

    # -- plumbing -----------------------------------------------------------------

    @classmethod
    async def connect(cls, addr: str, token: str, timeout: float | None = 30.0,
                      max_inflight: int | None = None,
                      tls: bool | ssl.SSLContext | None = None,
                      same_host: bool | None = None) -> RpcContext:
        """``rpcbuf.connect``: every step (TCP, hello, the same-host switch,
        the UCX bind) within one ``timeout``, not one each."""
        try:
            async with asyncio.timeout(timeout):
                return await cls._connect(addr, token, timeout, max_inflight, tls, same_host)
        except TimeoutError:
            raise Timeout(f"connecting to {addr} took longer than {timeout}s") from None

    @classmethod
    async def _connect(cls, addr: str, token: str, timeout: float | None,
                       max_inflight: int | None, tls: bool | ssl.SSLContext | None,
                       same_host: bool | None) -> RpcContext:
        if same_host is None:
            same_host = same_host_default()
        if addr.startswith("unix:"):  # the daemon's Unix socket itself: unix:PATH, unix:@NAME
            host, path = "127.0.0.1", addr[len("unix:"):]
            conn, hello = await _open(addr, timeout, token, unix=path,
                                      probe=same_host is not False)
        else:
            host, port = parse_addr(addr)
            tls_ctx = ssl.create_default_context() if tls is True else (tls or None)
            conn, hello = await _open(addr, timeout, token, tcp=(host, port, tls_ctx))
            local = hello.get("local")
            # Under TLS the same-host path only when asked for: it leaves TLS out.
            if local and same_host is not False and (tls_ctx is None or same_host):
                try:
                    switched = await _same_host(addr, timeout, token, local, same_host,
                                                replaces=hello.get("bind_nonce"))
                except BaseException:  # refused, or connect's deadline
                    conn.close()
                    raise
                if switched is not None:
                    conn.close()  # the TCP session held nothing yet
                    conn, hello = switched
        if same_host and not hello["same_host"]:
            conn.close()
            why = hello.get("same_host_why") or "the daemon offers no same-host socket"
            raise BadRequest(f"same_host=True, but the same-host path is not available: {why}")
        ctx = cls(conn, None, hello, timeout, max_inflight, ucx_host=host)
        if not ctx.same_host:
            try:  # bind now: a broken data path shows at connect, not at the first store
                await ctx._data_ep()
            except BaseException:
                conn.close()
                raise
        return ctx

    async def _data_ep(self) -> ucx.DataEndpoint:
        """The UCX endpoint, bound on first use."""
        if self._ep is not None:
            return self._ep
        async with self._ep_lock:
            if self._ep is None:
                self._check_open()
                self._ep = await _bind_ucx(self._ucx_host, self.hello, self.timeout,
                                           self._conn.lost_future())
                if self._conn.lost is not None:  # lost while we bound: do not keep it
                    self._ep.abort()
            return self._ep

    async def _call(self, req: P.Request, timeout: float | None = None) -> dict[str, Any]:
        left = await self._take_slot(req.op, timeout)
        try:
            req_id = self._conn.next_id()
            fut = self._conn.submit(req_id, req)
            return _result(await self._answer(req_id, fut, req.op, left))
        finally:
            self._slots.release()

    async def _take_slot(self, op: str, timeout: float | None) -> float | None:
        """Take an in-flight slot within ``timeout`` (default: the context's)
        and return what is left of it for the answer: the wait for a slot is
        part of the call's timeout, so a daemon that never answers cannot
        make later calls wait for ever.  Raises TIMEOUT."""
        timeout = self.timeout if timeout is None else timeout
        if not self._slots.locked() or timeout is None:
            await self._slots.acquire()  # a free slot: no suspension, no timer
            return timeout
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            async with asyncio.timeout(timeout):
                await self._slots.acquire()
        except TimeoutError:
            raise Timeout(f"{op} got no in-flight slot within {timeout}s (all "
                          f"{self.max_inflight} are waiting for answers)") from None
        return max(0.0, timeout - (loop.time() - start))

    async def _transfer(self, coros: Sequence[Awaitable[None]], arrays: Sequence[Any]) -> None:
        """UCX transfers under the daemon's transfer deadline, all awaited even
        when one fails (UCX may touch the arrays until each ends).  Past the
        deadline the context is aborted (UCX lets go of the arrays) and the call
        fails with CONNECTION_LOST; the daemon does the same on its side.
        When the control connection is lost (EOF, reset, deadline) the wait
        ends at once, whatever state the transfers are in: the endpoint is
        aborted by then (``on_lost``) and ``arrays`` stay referenced for the
        orphan grace, in case UCX still holds them."""
        try:
            await ucx.transfer_all(coros, self.transfer_timeout, self._expired,
                                   self._conn.lost_future())
        except ucx.Abandoned:
            self._conn.orphan(list(arrays))
            raise

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
        if self._ep is not None:
            await self._ep.close()
        self._conn.close()

    def abort(self) -> None:
        self._closed = True
        self._abort_ep()
        self._conn.close()

    # -- control ops ----------------------------------------------------------------

    async def request_buffer(self, size: int, device_type: str = "CPU", device: int = 0,
                             timeout: float | None = None, ttl: float | None = None,
                             name: str | None = None) -> str:
        """Reserve ``size`` bytes; wait up to ``timeout`` s for memory.

        Raises OUT_OF_MEMORY (details: requested, free, largest_free),
        QUOTA_EXCEEDED, UNSUPPORTED_DEVICE, BAD_REQUEST."""
        self._check_open()
        wait = None if not timeout else timeout + (self.timeout or 0)
        meta = await self._call(P.RequestBuffer(size=size, device_type=device_type, device=device,
                                                timeout=timeout, ttl=ttl, name=name),
                                timeout=wait if timeout else None)
        self._note_device(meta)
        return str(meta["buffer_id"])

    def _note_device(self, meta: dict[str, Any]) -> None:
        if str(meta.get("device_type", "CPU")).upper() == "GPU":
            self._gpu_buffers.add(str(meta["buffer_id"]))

    async def get_buffer_meta(self, buffer_id: str, tensors: bool = True,
                              timeout: float | None = None) -> dict[str, Any]:
        """The buffer's metadata; ``tensors=False`` leaves out the manifest's
        entries (a big manifest is a big answer). Raises NOT_FOUND."""
        self._check_open()
        meta = await self._call(P.GetBufferMeta(buffer_id=buffer_id, tensors=tensors), timeout)
        self._note_device(meta)
        if tensors:
            self._remember_manifest(buffer_id, meta)
        return meta

    async def release_buffer(self, buffer_id: str, timeout: float | None = None) -> None:
        """Raises NOT_FOUND."""
        self._check_open()
        await self._call(P.Release(buffer_id=buffer_id), timeout)
        self._gpu_buffers.discard(buffer_id)

    async def renew_buffer(self, buffer_id: str, ttl: float | None = None,
                           timeout: float | None = None) -> float | None:
        """Extend the lease; return the new expiry (unix time). Raises NOT_FOUND."""
        self._check_open()
        return (await self._call(P.Renew(buffer_id=buffer_id, ttl=ttl), timeout))["expires_at"]

    # ``timeout`` of a control op: seconds for the whole call, the wait for an
    # in-flight slot included (default: the context's); past it, TIMEOUT.

    async def list_devices(self, timeout: float | None = None) -> list[dict[str, Any]]:
        self._check_open()
        return list((await self._call(P.ListDevices(), timeout))["devices"])

    async def list_buffers(self, timeout: float | None = None) -> list[dict[str, Any]]:
        self._check_open()
        return list((await self._call(P.ListBuffers(), timeout))["buffers"])

    async def stats(self, timeout: float | None = None) -> dict[str, Any]:
        self._check_open()
        return await self._call(P.Stats(), timeout)

    async def ping(self, timeout: float | None = None) -> float:
        """Round trip to the daemon, in seconds. Raises TIMEOUT, CONNECTION_LOST."""
        self._check_open()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await self._call(P.Ping(), timeout)
        return loop.time() - t0

    # -- data ops -------------------------------------------------------------------

    async def store_tensor(self, buffer_id: str, array: Any, offset: int = 0, sync: bool = True,
                           verify: str | None = None, wire_dtype: str | None = None) -> Any:
        """Copy ``array``'s bytes into the buffer at ``offset`` (the daemon
        copies them itself on the same-host path, else they travel over UCX).

        ``array``: NumPy, PyTorch (CPU or CUDA), CuPy, or anything with the
        buffer protocol, ``__cuda_array_interface__`` or DLPack; no copy is
        made of a contiguous one (see ``control.arrays``).
        ``verify="checksum"`` has the daemon hash what it received and compare
        (xxh3; ``devsum`` when the array or the buffer is on a GPU, see
        docs/gpu.md).  ``wire_dtype="float16"`` sends a float32 tensor as
        float16 (half the bytes); the daemon widens it back into float32.
        ``sync=False`` returns a task at once (await it for the answer; keep
        the array unchanged until then).  Raises NOT_FOUND, OUT_OF_RANGE,
        VERIFY_FAILED, BAD_REQUEST, CONNECTION_LOST."""
        self._check_open()
        if verify not in (None, "checksum"):
            raise BadRequest(f"verify must be None or 'checksum', got {verify!r}")
        if wire_dtype is not None:
            check_wire_dtype(wire_dtype, dtype_name(array))
        gpu_buffer = isinstance(buffer_id, str) and buffer_id in self._gpu_buffers
        kind = "devsum" if gpu_buffer or is_cuda(array) else "xxh3"
        if wire_dtype is None:
            data, landed = as_bytes(array), None
        else:
            data, landed = to_wire_f16(array)
        coro = self._store(buffer_id, data, offset, verify, kind, wire_dtype, landed)
        if sync:
            return await coro
        return asyncio.get_running_loop().create_task(coro)

    async def _store(self, buffer_id: str, data: Any, offset: int, verify: str | None,
                     kind: str = "xxh3", wire_dtype: str | None = None,
                     landed: Any = None) -> dict[str, Any]:
        """``landed``: the bytes the buffer will hold when they differ from
        the payload (wire fp16); the checksum covers what lands."""
        prepare(data)
        final = data if landed is None else landed
        digest = None
        if verify:
            digest = devsum(final) if kind == "devsum" else checksum(final)
        local = self._local(buffer_id, [data])
        req = P.Store(buffer_id=buffer_id, offset=offset, nbytes=int(final.nbytes),
                      checksum=digest, verify=verify,  # type: ignore[arg-type]
                      checksum_kind=kind if verify and kind != "xxh3" else None,  # type: ignore[arg-type]
                      wire_dtype=wire_dtype,  # type: ignore[arg-type]
                      addr=int(data.ctypes.data) if local else None)
        if local:
            try:
                return await self._local_request(req, [data])
            except BadRequest as exc:
                if not self._fall_back(buffer_id, exc):
                    raise
                req = dataclasses.replace(req, addr=None)
        return await self._send_request(req, [data] if data.nbytes else [])

    async def read_buffer(self, buffer_id: str, offset: int = 0, nbytes: int | None = None,
                          out: Any = None) -> np.ndarray:
        """Read ``nbytes`` (default: ``out``'s size, else to the buffer's end)
        straight into ``out`` (or a new uint8 array), which is returned.

        Raises NOT_FOUND, OUT_OF_RANGE, BAD_REQUEST, CONNECTION_LOST."""
        self._check_open()
        target = as_bytes(out, writable=True) if out is not None else None
        if nbytes is None:
            if target is not None:
                nbytes = int(target.nbytes)
            else:
                meta = await self.get_buffer_meta(buffer_id)
                nbytes = int(meta["size"]) - offset
        if not isinstance(nbytes, int) or nbytes < 0:
            raise BadRequest(f"nbytes must be a non-negative int, got {nbytes!r}")
        if target is None:
            target = np.empty(nbytes, dtype=np.uint8)
        elif target.nbytes < nbytes:
            raise BadRequest(f"out holds {target.nbytes} bytes, {nbytes} requested")
        dest = target[:nbytes]
        prepare(dest)  # GPU work still using ``out`` finishes before it is overwritten
        local = self._local(buffer_id, [dest])
        req = P.Read(buffer_id=buffer_id, offset=offset, nbytes=nbytes,
                     addr=int(dest.ctypes.data) if local else None)
        if local:
            try:
                await self._local_request(req, [dest])
                return out if out is not None else target
            except BadRequest as exc:
                if not self._fall_back(buffer_id, exc):
                    raise
                req = dataclasses.replace(req, addr=None)
        await self._receive_request(req, [dest] if nbytes else [])
        return out if out is not None else target

    async def open_buffer(self, name: str, timeout: float | None = None) -> str:
        """The id of this tenant's buffer called ``name``. Raises NOT_FOUND."""
        self._check_open()
        meta = await self._call(P.OpenBuffer(name=name), timeout)
        self._note_device(meta)
        return str(meta["buffer_id"])

    async def clear_buffer(self, buffer_id: str, value: int = 0, offset: int = 0,
                           nbytes: int | None = None) -> None:
        """Set bytes to ``value`` on the daemon (no bytes cross the network).
        Raises NOT_FOUND, OUT_OF_RANGE, BAD_REQUEST."""
        self._check_open()
        await self._call(P.ClearBuffer(buffer_id=buffer_id, value=value, offset=offset,
                                       nbytes=nbytes))

    async def copy_buffer(self, src_id: str, src_offset: int, dst_id: str, dst_offset: int,
                          nbytes: int) -> None:
        """Copy between (or within) this tenant's buffers on the daemon's node,
        without moving bytes over the network. Raises NOT_FOUND, OUT_OF_RANGE."""
        self._check_open()
        await self._call(P.CopyBuffer(src_id=src_id, src_offset=src_offset, dst_id=dst_id,
                                      dst_offset=dst_offset, nbytes=nbytes))

    async def store_batch(self, buffer_id: str, items: Sequence[tuple[int, Any]],
                          verify: str | None = None,
                          manifest: tuple[list[str], list[str], list[list[int]]] | Packed
                          | None = None,
                          manifest_version: int | None = None) -> dict[str, Any]:
        """Store many ``(offset, array)`` items of one buffer in one control
        round trip; the daemon copies them straight from the arrays (same
        host), or touching small items travel as one UCX message each run;
        either way they land straight in their slices.  ``manifest`` = (names, dtypes,
        shapes), index-aligned with ``items``, is recorded on the daemon;
        with ``manifest_version`` the daemon refuses (BAD_REQUEST, reason
        ``manifest_changed``, before any byte lands) if the manifest changed.
        The answer's ``checksums`` (with a manifest) are index-aligned with
        ``items`` too.
        Raises NOT_FOUND, OUT_OF_RANGE, VERIFY_FAILED, BAD_REQUEST."""
        self._check_open()
        if verify not in (None, "checksum"):
            raise BadRequest(f"verify must be None or 'checksum', got {verify!r}")
        n = len(items)
        known: np.ndarray | None = None  # the items' sizes, when given as columns
        if isinstance(items, Items):
            offsets, arrays, known = items.offsets.astype(np.int64), items.arrays, items.sizes
        else:
            try:
                offsets = np.fromiter(map(_FIRST, items), dtype=np.int64, count=n)
                arrays = list(map(_SECOND, items))
            except (TypeError, ValueError, OverflowError, IndexError):
                raise BadRequest("items must be (offset, array) pairs with integer "
                                 "offsets") from None
        if n and offsets.min() < 0:
            raise BadRequest("offsets must be non-negative")
        packed = _packed(manifest, n)
        order = offset_order(offsets)
        if order is not None:
            offsets = offsets[order]
            arrays = [arrays[i] for i in order.tolist()]
            packed = packed.take(order) if packed is not None else None
            known = known[order] if known is not None else None
        datas = _host_data(arrays)
        if known is None or datas is not arrays:
            sizes = np.fromiter(map(_NBYTES, datas), dtype=np.uint64, count=n)
        else:
            sizes = known.astype(np.uint64)
        offsets_u = offsets.astype(np.uint64)
        sums = P.pack_u64(np.fromiter(map(XXH3, datas), dtype=np.uint64,
                                      count=n)) if verify else None
        req = P.StoreBatch(buffer_id=buffer_id, offsets=P.pack_u64(offsets_u),
                           sizes=P.pack_u64(sizes), checksums=sums,
                           verify=verify,  # type: ignore[arg-type]
                           manifest_version=manifest_version,
                           **(packed.fields() if packed is not None else {}))
        if self._local(buffer_id, datas):
            try:
                return _in_caller_order(await self._local_request(
                    dataclasses.replace(req, addrs=P.pack_u64(data_addresses(datas))), datas),
                    order)
            except BadRequest as exc:
                if not self._fall_back(buffer_id, exc):
                    raise
        payloads = [_payload(datas[first:stop])
                    for _, _, first, stop in plan_runs(offsets_u, sizes)]
        return _in_caller_order(await self._send_request(req, payloads), order)

    async def read_batch(self, buffer_id: str,
                         ranges: Sequence[tuple[int, int]]) -> list[np.ndarray]:
        """Read many ``(offset, nbytes)`` ranges of one buffer in one round
        trip; returns uint8 arrays in the order asked.  Ranges close together
        are read as one span (``tensors.plan_spans``) and come back as views
        into it.  Raises NOT_FOUND, OUT_OF_RANGE, BAD_REQUEST."""
        self._check_open()
        n = len(ranges)
        try:
            offsets = np.fromiter(map(_FIRST, ranges), dtype=np.int64, count=n)
            sizes = np.fromiter(map(_SECOND, ranges), dtype=np.int64, count=n)
        except (TypeError, ValueError, OverflowError, IndexError):
            raise BadRequest("ranges must be (offset, nbytes) pairs of ints") from None
        if n and (offsets.min() < 0 or sizes.min() < 0):
            raise BadRequest("offsets and sizes must be non-negative")
        order = offset_order(offsets)
        if order is not None:
            offsets, sizes = offsets[order], sizes[order]
        starts, lengths, span_of = plan_spans(offsets, sizes)
        starts_u, lengths_u = starts.astype(np.uint64), lengths.astype(np.uint64)
        req = P.ReadBatch(buffer_id=buffer_id, offsets=P.pack_u64(starts_u),
                          sizes=P.pack_u64(lengths_u))
        # One block per run of spans (spans never touch, so in practice one
        # per span); each span lands at its place in its block.
        runs = plan_runs(starts_u, lengths_u)
        blocks = [np.empty(nb, dtype=np.uint8) for _, nb, _, _ in runs]
        block_of = np.repeat(np.arange(len(runs), dtype=np.intp),
                             [stop - first for _, _, first, stop in runs])
        in_block = starts - np.array([off for off, _, _, _ in runs], dtype=np.int64)[block_of] \
            if runs else starts
        if self._local(buffer_id, blocks):
            addrs = data_addresses(blocks)[block_of] + in_block.astype(np.uint64) \
                if runs else np.zeros(0, np.uint64)
            for block in blocks:
                if block.nbytes >= _POPULATE_MIN:
                    populate(block)
            try:
                await self._local_request(dataclasses.replace(req, addrs=P.pack_u64(addrs)),
                                          blocks)
                return _byte_views(blocks, block_of, in_block, span_of, offsets, starts,
                                   sizes, order)
            except BadRequest as exc:
                if not self._fall_back(buffer_id, exc):
                    raise
        await self._receive_request(req, blocks)
        return _byte_views(blocks, block_of, in_block, span_of, offsets, starts, sizes, order)

    # -- the same-host path -----------------------------------------------------------

    def _local(self, buffer_id: str, arrays: Sequence[Any]) -> bool:
        """Whether these arrays of this buffer can take the same-host path."""
        return (self.same_host and isinstance(buffer_id, str)
                and buffer_id not in self._gpu_buffers
                and all(isinstance(a, np.ndarray) for a in arrays))

    def _fall_back(self, buffer_id: str, exc: BadRequest) -> bool:
        """A GPU buffer we did not know about: note it, and use UCX."""
        if exc.details.get("reason") == "device_memory":
            self._gpu_buffers.add(buffer_id)
            return True
        return False

    async def _local_request(self, req: P.Request, arrays: Sequence[Any]) -> dict[str, Any]:
        """A request whose addresses the daemon copies from or into: the
        arrays stay referenced until it answers (even if we stop waiting)."""
        left = await self._take_slot(req.op, None)
        try:
            req_id = self._conn.next_id()
            fut = self._conn.submit(req_id, req)
            self._conn.hold(req_id, arrays)
            return _result(await self._answer(req_id, fut, req.op, left))
        finally:
            self._slots.release()

    # -- the UCX path ------------------------------------------------------------------

    async def _send_request(self, req: P.Request, payloads: list[np.ndarray]) -> dict[str, Any]:
        """A store-like request: payload run ``i`` goes out on ``run_tag(id, i)``
        at once, while the daemon checks the request (one round trip)."""
        ep = await self._data_ep() if payloads else None
        left = await self._take_slot(req.op, None)
        try:
            req_id = self._conn.next_id()
            fut = self._conn.submit(req_id, req)
            sent: BaseException | None = None
            try:
                if ep is not None:
                    await self._transfer([ep.send(p, run_tag(req_id, i))
                                          for i, p in enumerate(payloads) if p.nbytes], payloads)
            except ucx.TransferError as exc:
                sent = exc
            result = _result(await self._answer(req_id, fut, req.op, left))
            if sent is not None:
                raise ConnectionLost(f"payload send failed: {sent}") from sent
            return result
        finally:
            self._slots.release()

    async def _receive_request(self, req: P.Request,
                               targets: list[np.ndarray]) -> None:
        """A read-like request: once the daemon says yes, run ``i`` is received
        straight into ``targets[i]``; on an error answer nothing was sent."""
        ep = await self._data_ep() if targets else None
        left = await self._take_slot(req.op, None)
        try:
            req_id = self._conn.next_id()
            fut = self._conn.submit(req_id, req)
            _result(await self._answer(req_id, fut, req.op, left))
            try:
                if ep is not None:
                    await self._transfer([ep.recv(t, run_tag(req_id, i))
                                          for i, t in enumerate(targets) if t.nbytes], targets)
            except ucx.TransferError as exc:
                raise ConnectionLost(f"{req.op} transfer failed: {exc}") from exc
        finally:
            self._slots.release()

    async def _answer(self, req_id: int, fut: asyncio.Future[dict[str, Any]], op: str,
                      timeout: float | None = None) -> dict[str, Any]:
        """The answer to request ``req_id``, within ``timeout`` (default: the
        context's); on TIMEOUT the request is forgotten, the connection stays."""
        timeout = self.timeout if timeout is None else timeout
        if timeout is None:
            return await fut
        # A timer on the future itself: asyncio.timeout (a Timeout object that
        # cancels and uncancels the task) cost ~4 us a call here, this ~0.7 us.
        timer = asyncio.get_running_loop().call_later(timeout, _expire, fut)
        try:
            return await fut
        except TimeoutError:
            self._conn.forget(req_id)
            raise Timeout(f"{op} got no answer within {timeout}s") from None
        finally:
            timer.cancel()

    async def verify_write(self, buffer_id: str, offset: int, array: Any) -> bool:
        """Read the range back over the data plane and compare it with ``array``.

        Returns True when equal; raises VERIFY_FAILED (with the first differing
        byte) when not."""
        data = as_bytes(array)
        if not isinstance(data, np.ndarray):  # device memory: compare on the host
            data = data.get()
        back = await self.read_buffer(buffer_id, offset, int(data.nbytes))
        if not np.array_equal(back, data):
            first = int(np.flatnonzero(back != data)[0])
            raise VerifyFailed("read-back differs from the array",
                               {"offset": offset, "first_difference": first})
        return True


class _Closable(Protocol):
    async def close(self) -> None: ...


_C = TypeVar("_C", bound=_Closable)


class Opening(Generic[_C]):
    """Something being opened: ``await`` it, or use it with ``async with``
    (closed on the way out)."""

    def __init__(self, open_: Callable[[], Awaitable[_C]]) -> None:
        self._open = open_
        self._opened: _C | None = None

    def __await__(self) -> Generator[Any, None, _C]:
        return self._open().__await__()

    async def __aenter__(self) -> _C:
        self._opened = await self._open()
        return self._opened

    async def __aexit__(self, *exc: object) -> None:
        if self._opened is not None:
            await self._opened.close()


class Connector(Opening[RpcContext]):
    """What ``connect()`` returns: ``await`` it, or use it with ``async with``."""

    def __init__(self, addr: str, token: str, timeout: float | None,
                 max_inflight: int | None = None,
                 tls: bool | ssl.SSLContext | None = None,
                 same_host: bool | None = None) -> None:
        super().__init__(lambda: RpcContext.connect(addr, token, timeout, max_inflight, tls,
                                                    same_host))


def connect(addr: str, token: str, timeout: float | None = 30.0,
            max_inflight: int | None = None, *,
            tls: bool | ssl.SSLContext | None = None,
            same_host: bool | None = None) -> Connector:
    """Open a session with the rpcbufd at ``addr`` ("host:port", or
    "unix:PATH" / "unix:@NAME" for the daemon's Unix socket).

    On the daemon's own host the session takes the same-host path (the daemon
    copies host arrays straight from and into this process; see
    docs/performance.md): ``same_host=None`` (default; env
    ``RPCBUF_SAME_HOST``) takes it when it can, ``False`` never (UCX over the
    network stack), ``True`` requires it (BAD_REQUEST saying why if not).
    ``ctx.same_host`` tells which path the context got.

    ``timeout`` bounds each control call; ``max_inflight`` caps this client's
    requests on the wire (at most the daemon's limit): more calls wait their
    turn instead of queueing without bound.  ``tls=True`` speaks TLS on the
    control channel, verified against the system's CAs and the host name in
    ``addr``; pass an ``ssl.SSLContext`` for your own CA or client certificate.
    The data plane (UCX) is not encrypted by this; with TLS the same-host
    path is used only when ``same_host=True`` (it leaves TLS out).
    Raises AUTH_FAILED, TOKEN_EXPIRED, CONNECTION_LOST (also for a failed TLS
    handshake), TIMEOUT, QUOTA_EXCEEDED (the daemon's --max-sessions),
    SHUTTING_DOWN."""
    return Connector(addr, token, timeout, max_inflight, tls, same_host)


# -- opening a session --------------------------------------------------------------


async def _open(addr: str, timeout: float | None, token: str, *,
                tcp: tuple[str, int, ssl.SSLContext | None] | None = None,
                unix: str | None = None, probe: bool = False, replaces: bytes | None = None,
                daemon_pid: int | None = None) -> tuple[ControlConnection, dict[str, Any]]:
    """Connect (TCP or Unix socket) and say hello; with ``probe`` the hello
    asks for the same-host path.  On a Unix socket the peer is checked
    (``check_unix_peer``; ``daemon_pid``: the pid the daemon's TCP hello
    named) before the token goes out.  The answer is checked
    (``hello.check_hello``) before anything trusts it."""
    try:
        async with asyncio.timeout(timeout):
            loop = asyncio.get_running_loop()
            if unix is not None:
                sock = await _unix_socket(unix)
                try:
                    peer_pid = check_unix_peer(sock, unix, daemon_pid)
                except BaseException:
                    sock.close()
                    raise
                if probe and peer_pid:
                    # Yama ptrace_scope 1: let the daemon copy to and from us; the
                    # pid the kernel names, never one a daemon claims.
                    cma.allow_tracer(peer_pid)
                _, conn = await loop.create_unix_connection(ControlConnection, sock=sock)
            else:
                assert tcp is not None
                _, conn = await loop.create_connection(ControlConnection, tcp[0], tcp[1],
                                                       ssl=tcp[2])
    except TimeoutError:
        raise Timeout(f"connecting to {addr} timed out") from None
    except OSError as exc:
        raise ConnectionLost(f"cannot reach rpcbufd at {addr}: {exc}") from exc
    secret = np.frombuffer(os.urandom(16), dtype=np.uint8).copy()
    hello = P.Hello(token=token, probe=secret.tobytes() if probe else None,
                    probe_addr=int(secret.ctypes.data) if probe else None, replaces=replaces)
    try:
        fut = conn.submit(conn.next_id(), hello)
        async with asyncio.timeout(timeout):
            answer = _result(await fut)
        return conn, check_hello(answer, unix=unix is not None)
    except TimeoutError:
        conn.close()
        raise Timeout(f"handshake with {addr} timed out") from None
    except ConnectionLost:
        conn.close()
        if conn.lost is not None and not isinstance(conn.lost, ConnectionLost):
            raise conn.lost from None  # the daemon said why: QUOTA_EXCEEDED, SHUTTING_DOWN
        raise
    except BaseException:
        conn.close()
        raise
    finally:
        del secret  # read by the daemon during hello; not needed after


async def _unix_socket(name: str) -> socket.socket:
    """A socket connected to a Unix socket: a path, or "@NAME" for an abstract
    one.  We connect it ourselves: uvloop refuses abstract names (EINVAL)."""
    path = "\0" + name[1:] if name.startswith("@") else name
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, path)
    except BaseException:
        sock.close()
        raise
    return sock


def check_unix_peer(sock: socket.socket, name: str, daemon_pid: int | None,
                    trusted: frozenset[int] | None = None) -> int:
    """Check who listens on Unix socket ``name`` (connected ``sock``) before
    our token goes to it; returns the peer's pid (0: outside our pid
    namespace).  ``SO_PEERCRED`` is what the kernel says, not what the peer
    claims.  Trusted: a peer running as root, as us, or (a path socket) as
    the owner of the socket file; ``trusted`` replaces the first two (tests).
    The peer must be a live process, and the one the daemon's TCP hello
    named (``daemon_pid``) when we came from there: an abstract name has no
    owner, anyone may bind one the daemon is not holding, so there the pid
    is what proves it.  Raises FORBIDDEN."""
    pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                      struct.calcsize("3i")))
    ok_uids = {0, os.getuid()} if trusted is None else set(trusted)
    if not name.startswith("@"):
        with contextlib.suppress(OSError):
            ok_uids.add(os.stat(name).st_uid)
    who = f"the process behind unix:{name} (pid {pid}, uid {uid})"
    if pid and not _alive(pid):
        raise Forbidden(f"{who} does not exist; the token was not sent")
    if daemon_pid is not None and pid and pid != daemon_pid:
        raise Forbidden(f"{who} is not the daemon (pid {daemon_pid}); the token was not sent")
    if uid not in ok_uids and (daemon_pid is None or not pid):
        raise Forbidden(f"{who} is not trusted (root, this user, or the socket file's "
                        f"owner); the token was not sent", {"uid": uid})
    return pid


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists (signal 0: checks, sends nothing; works
    where /proc hides other users' processes, hidepid)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, another user's
    return True


async def _same_host(addr: str, timeout: float | None, token: str, local: dict[str, Any],
                     required: bool | None, replaces: bytes | None
                     ) -> tuple[ControlConnection, dict[str, Any]] | None:
    """Reconnect on the daemon's Unix socket if it is on this host.  None: stay."""
    if local.get("boot_id") != cma.boot_id():
        return None  # another host (or kernel)
    sock = str(local["socket"])
    try:
        return await _open(f"unix:{sock}", timeout, token, unix=sock, probe=True,
                           replaces=replaces, daemon_pid=int(local["pid"]))
    except RpcBufError as exc:
        # Another network namespace (abstract sockets are per namespace), a
        # socket we may not open, a refused hello: the network path still works.
        if required:
            raise
        log.debug("same-host socket %s of %s unreachable: %s", sock, addr, exc)
        return None


async def _bind_ucx(host: str, hello: dict[str, Any], timeout: float | None,
                    lost: asyncio.Future[None] | None = None) -> ucx.DataEndpoint:
    """A UCX endpoint to the daemon, bound to this session by its nonce:
    within ``timeout``, and at once CONNECTION_LOST when ``lost`` (the
    control connection) ends first."""
    limit = timeout if timeout else 30.0
    try:
        ep = await ucx.connect(host, int(hello["ucx"]["port"]), timeout=limit)
    except ucx.TransferError as exc:
        raise ConnectionLost(f"UCX connection to {host} failed: {exc}") from exc
    expired = False

    def expire() -> None:
        nonlocal expired
        expired = True
        ep.abort()

    ack = np.zeros(1, dtype=np.uint8)
    try:
        await ucx.transfer_all([ep.send(np.frombuffer(hello["bind_nonce"], dtype=np.uint8),
                                        ucx.BIND_TAG), ep.recv(ack, ucx.BIND_TAG)],
                               limit, expire, lost)
        if ack[0] != 1:
            raise ConnectionLost("daemon refused to bind the data endpoint")
    except ucx.Abandoned:
        ep.abort()
        raise ConnectionLost(f"the control connection to {host} was lost while binding "
                             "the UCX endpoint") from None
    except ucx.TransferError as exc:
        ep.abort()
        if expired:
            raise Timeout(f"binding the UCX endpoint at {host} timed out") from None
        raise ConnectionLost(f"UCX connection to {host} failed: {exc}") from exc
    except BaseException:
        ep.abort()
        raise
    return ep


def create_rpc_context(server_addr: str, auth_token: str,
                       timeout: float | None = 30.0) -> Connector:
    """The tutorial's name for ``connect``."""
    return connect(server_addr, auth_token, timeout)


# -- batches: helpers of store_batch and read_batch -----------------------------------

_POPULATE_MIN = 1 << 20  # same-host reads: blocks this big are faulted in here first
_FIRST = operator.itemgetter(0)
_SECOND = operator.itemgetter(1)
_NBYTES = operator.attrgetter("nbytes")
_C_CONTIGUOUS = operator.attrgetter("flags.c_contiguous")


def _packed(manifest: tuple[list[str], list[str], list[list[int]]] | Packed | None,
            n: int) -> Packed | None:
    if manifest is None:
        return None
    packed = manifest if isinstance(manifest, Packed) else Packed.of_columns(*manifest)
    if len(packed) != n:
        raise BadRequest(f"the manifest lists {len(packed)} tensors for {n} items")
    return packed


def _host_data(arrays: list[Any]) -> list[np.ndarray]:
    """The arrays themselves when all are C-contiguous NumPy arrays (the
    common case: no per-array work), else flat uint8 views (``as_bytes``)."""
    if all(map(isinstance, arrays, itertools.repeat(np.ndarray))) \
            and all(map(_C_CONTIGUOUS, arrays)):
        return arrays
    datas = [as_bytes(a) for a in arrays]
    if not all(isinstance(d, np.ndarray) for d in datas):
        raise BadRequest("store_batch takes host arrays; store GPU tensors with store_tensor")
    return datas


def _payload(datas: list[np.ndarray]) -> np.ndarray:
    """One UCX message: the bytes of a run of touching items, back to back."""
    if len(datas) == 1:
        return as_bytes(datas[0])
    if len({d.dtype for d in datas}) == 1:  # one dtype: NumPy flattens and joins in C
        return np.concatenate(datas, axis=None).view(np.uint8)
    return np.concatenate([as_bytes(d) for d in datas])


def _in_caller_order(result: dict[str, Any], order: np.ndarray | None) -> dict[str, Any]:
    """The daemon answers per item in offset order: put ``checksums`` back
    in the order the caller gave the items."""
    if order is not None and result.get("checksums"):
        sums = P.unpack_u64(result["checksums"])
        back = np.empty_like(sums)
        back[order] = sums
        result["checksums"] = P.pack_u64(back)
    return result


def _byte_views(blocks: list[np.ndarray], block_of: np.ndarray, in_block: np.ndarray,
                span_of: np.ndarray, offsets: np.ndarray, starts: np.ndarray,
                sizes: np.ndarray, order: np.ndarray | None) -> list[np.ndarray]:
    """read_batch's answer: each (offset-sorted) item as a uint8 view into
    its block, in the order the caller asked."""
    if not len(sizes):
        return []
    rel = offsets - starts[span_of] + in_block[span_of]
    uniq, kinds = np.unique(sizes, return_inverse=True)
    views = bulk_views(blocks, block_of[span_of], rel, kinds.reshape(-1),
                       [np.dtype(np.uint8)] * len(uniq), [(int(u),) for u in uniq.tolist()])
    return in_caller_order(views, order)

"""The data path: how the bytes of a data op travel, chosen once per session.

A session has two ``ClientPath`` implementations: ``UcxClientPath`` (a UCX
endpoint bound to the session by its nonce, dialled on first use on a
same-host session) and either, when ``hello`` granted it and the handle
channel is bound (``handles.py``), ``StagedClientPath`` (our host arrays are
copied into or out of the session's staging area, shared memory the daemon
made; the daemon copies between it and its arena) or, on a network session
whose daemon allows it (``inline_max``), ``InlineClientPath`` (a small op's bytes
in its control frames).  ``DataPaths.choose`` is the one rule that picks a
path per op: for host arrays of a host buffer the same-host path, else
the inline path when it is a small plain store or read; UCX for everything
else (GPU arrays, GPU buffers, big ops).  A buffer's
device is what the daemon stated (``BufferPlace``, from its metadata), never
guessed; the one fallback left, in ``DataPaths.run``, is for a daemon whose
buffer turned out to be device memory after all (it refuses the staged op
with reason ``device_memory`` before touching a byte): noted, and rerun over
UCX.

The ops (``rangeops.py``, ``batches.py``, ``blockops.py``) describe their bytes once, as a
``Transfer``; each path takes what it needs from it.

Checklist for a new path (shared-memory handles, CUDA device-to-device,
RDMA), touching nothing else on the client side:

1. a class here with ``send(t)`` (store-like: the bytes of ``t.arrays``
   leave, the daemon's result comes back once they landed) and
   ``receive(t)`` (read-like: the daemon says yes, then the bytes land in
   ``t.arrays``), each within the call's in-flight slot and timeout
   (``Caller``) and, for the transfer, the daemon's transfer deadline;
2. its name on the wire (``P.PathName``) and whatever it adds to the
   request (a staging slot, handles, keys), set in one place, as
   ``StagedClientPath`` sends ``t.request.replace(path="staged", stage=slot)``;
3. every array the transport may touch stays referenced until it is done
   with it, even when we stop waiting (UCX: the orphan grace,
   ``ControlConnection.orphan``; the staged path's own threads hold theirs);
4. on a lost control connection every wait ends at once with
   CONNECTION_LOST (``conn.lost_future()``);
5. its case in ``DataPaths.choose`` (which buffers and arrays it takes) and
   its ``close``/``abort`` in ``DataPaths``;
6. its counterpart on the daemon (``control/daemon``'s data path).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np

from rpcbuf.control.client.connection import Caller, result_of
from rpcbuf.control.ucx_errors import ucx_errors
from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.errors import BadRequest, ConnectionLost, RpcBufError, Timeout
from rpcbuf.control.wire.runs import run_tag
from rpcbuf.dataplane import staging, ucx


@dataclass(frozen=True, slots=True)
class BufferPlace:
    """Where a buffer lives, as the daemon stated it (its metadata, and the
    hello's ``checksum_kinds``): what routes its bytes and checks them."""

    gpu: bool
    checksum_kind: str  # what a plain store into it is verified with


class Transfer(NamedTuple):
    """One data op's bytes, described once for every path.

    ``request``: the op's request on the UCX path; each other path sends a
    copy naming itself (``path``): the staged path's names a staging slot,
    whose bytes are those of ``arrays`` (host arrays, contiguous), back to
    back in order -- the order of the UCX runs.  ``messages()``: the UCX
    messages, message ``i`` on ``run_tag(id, i)``.  ``inline``: a plain
    store or read, whose bytes may ride in its frames (``InlineClientPath``).
    (A named tuple and a closure: made per op, so cheap to make.)"""

    request: P.DataRequest
    arrays: Sequence[Any]
    messages: Callable[[], list[Any]]
    inline: bool = False


class ClientPath(Protocol):
    """See the module's checklist."""

    async def send(self, t: Transfer) -> dict[str, Any]: ...

    async def receive(self, t: Transfer) -> dict[str, Any]: ...


class StagedClientPath:
    """The same-host path: our bytes meet the daemon's in the session's
    staging area (``dataplane/staging.py``, shared memory the daemon made
    and sent over the handle channel, ``handles.py``); we copy our arrays
    in or out, the daemon copies between it and its arena.  The daemon never
    touches our memory.

    An op of at most ``staging.SMALL`` bytes takes one of the small slots: a
    store copies its bytes in, then asks; a read asks, then copies out.  A
    bigger op takes the ring (one op at a time): we copy chunk ``k + 1`` in
    (or out) on a worker thread while the daemon copies chunk ``k``.  A slot
    (or the ring) whose request we stopped waiting for (timeout, cancel) may
    still be in use by the daemon: it is retired for good, never reused; the
    ring retired, big ops go over UCX.  The mapping is the session's
    (``handles.py`` unmaps it when the context closes): every copy here
    first checks it is still there (``_live``), and a ring thread holds it
    (``staging.Shared.hold``) until the thread returned."""

    def __init__(self, caller: Caller, shared: staging.Shared, transfer_timeout: float) -> None:
        self._caller, self._conn, self._shared = caller, caller.conn, shared
        self.area = shared.area
        self._timeout = transfer_timeout
        self._free: asyncio.Queue[int] = asyncio.Queue()
        for slot in range(staging.SMALL_SLOTS):
            self._free.put_nowait(slot)
        self._ring = asyncio.Lock()
        self.ring_ok = True  # False once retired

    def takes(self, arrays: Sequence[Any]) -> bool:
        """Whether this path can carry an op of these host arrays now."""
        return self.ring_ok or sum(int(a.nbytes) for a in arrays) <= staging.SMALL

    async def send(self, t: Transfer) -> dict[str, Any]:
        return await self._op(t, store=True)

    async def receive(self, t: Transfer) -> dict[str, Any]:
        return await self._op(t, store=False)

    async def _op(self, t: Transfer, store: bool) -> dict[str, Any]:
        pieces = _flat(t.arrays)
        nbytes = sum(p.nbytes for p in pieces)
        if nbytes > staging.SMALL:
            return await self._ring_op(t, pieces, nbytes, produce=store)
        slot = await self._small_slot()
        area, ok = self.area, False
        try:
            if store:  # our bytes first, then the request
                staging.gather(pieces, area.small(slot, self._live(nbytes)))
            result = await self._caller.call(t.request.replace(path="staged", stage=slot))
            if not store:  # the answer says the slot holds them
                staging.scatter(area.small(slot, self._live(nbytes)), pieces)
            ok = True
            return result
        except RpcBufError as exc:
            ok = not isinstance(exc, Timeout)  # the daemon answered: it is done with the slot
            raise
        finally:
            if ok:
                self._free.put_nowait(slot)

    def _live(self, nbytes: int) -> int:
        """``nbytes``, once we know the mapping is still there (a copy
        resumed after the context closed would touch unmapped memory).
        Raises CONNECTION_LOST."""
        if self._shared.closed:
            raise ConnectionLost("context is closed")
        return nbytes

    async def _small_slot(self) -> int:
        try:
            return self._free.get_nowait()
        except asyncio.QueueEmpty:
            pass
        timeout = self._caller.timeout
        try:
            async with asyncio.timeout(timeout):
                return await self._free.get()
        except TimeoutError:
            raise Timeout(f"no staging slot came free within {timeout}s") from None

    async def _ring_op(self, t: Transfer, pieces: list[np.ndarray], nbytes: int,
                       produce: bool) -> dict[str, Any]:
        """A big op through the ring.  Store (``produce``): the request goes
        first (the daemon looks up and locks while we copy), then our thread
        fills the ring; read: the request goes, our thread empties the ring
        as the daemon fills it.  The daemon answers once it is done with the
        ring; our thread stops early only when the answer is an error."""
        if not self.ring_ok:
            raise ConnectionLost("the staging ring was retired")  # DataPaths picks UCX first
        await self._ring.acquire()
        area, caller = self.area, self._caller
        retire = True
        try:
            self._live(nbytes)
            area.reset()
            one = nbytes <= staging.RING_CHUNK
            if produce and one:  # one chunk: in place before the request, no thread
                staging.gather(pieces, area.chunk(0))
                area.put(staging.PRODUCED, 1)
            ring = _Ring(self._shared, pieces, one, produce, self._timeout)
            result = await caller.call(t.request.replace(path="staged", stage=staging.RING),
                                       moves=ring)
            retire = False
            return result
        except RpcBufError as exc:
            retire = isinstance(exc, Timeout)
            raise
        except staging.Stopped as exc:  # the ring may be mid-copy: retired
            raise ConnectionLost(f"same-host transfer stopped: {exc}") from exc
        finally:
            if retire:
                self.ring_ok = False
            self._ring.release()


class _Ring:
    """The bytes of a big same-host op beside its answer.  One chunk
    (``one``) needs no thread: a store's is in the ring before the request
    goes, a read's is copied out once the daemon answered (it answers when
    it is done with the ring).  Otherwise our thread fills the ring (store)
    or empties it (read) as the daemon copies, and stops early only when
    the answer is an error."""

    def __init__(self, shared: staging.Shared, pieces: list[np.ndarray], one: bool,
                 produce: bool, timeout: float) -> None:
        self._shared, self._area, self._pieces, self._one = shared, shared.area, pieces, one
        self._produce, self._timeout = produce, timeout

    async def run(self, req_id: int, fut: asyncio.Future[dict[str, Any]],
                  answer: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
        pump: asyncio.Future[None] | None = None
        if not self._one:
            refused = threading.Event()  # the thread stops early on an error answer
            fut.add_done_callback(lambda f: refused.set() if _refused(f) else None)
            deadline = time.monotonic() + self._timeout
            shared = self._shared
            shared.hold()  # the mapping stays until the thread returned, closed or not
            try:
                pump = asyncio.get_running_loop().run_in_executor(
                    None, self._area.pump, self._pieces, self._produce, refused.is_set,
                    deadline)
            except BaseException:
                shared.let_go()
                raise
            # Its Stopped is read below only when the daemon's answer was a
            # success; read it here always (a refused or lost op stops it
            # too), or it is printed when the future goes.
            pump.add_done_callback(_read_exception)
            pump.add_done_callback(lambda _: shared.let_go())
        try:
            msg = await answer()
        finally:
            if pump is not None:
                await asyncio.wait([pump])  # our thread is done with the arrays
                if pump.done() and not pump.cancelled():
                    pump.exception()  # retrieved: a cancelled store stops it short
        result = result_of(msg)  # the daemon's error, if it refused
        if pump is not None:
            pump.result()  # ours: it stopped short (deadline): staging.Stopped
        elif not self._produce:  # one chunk, read: the daemon is done with the ring
            if self._shared.closed:  # closed while we waited: unmapped
                raise ConnectionLost("context is closed")
            staging.scatter(self._area.chunk(0), self._pieces)  # (scatter takes what they hold)
        return result


def inline_on() -> bool:
    """Whether small ops of network sessions ride in their frames:
    ``RPCBUF_INLINE=0`` sends every payload as a UCX message (to test or
    compare the UCX path itself)."""
    return os.environ.get("RPCBUF_INLINE", "").strip().lower() not in ("0", "false", "no", "off")


class InlineClientPath:
    """Small host ops of a network session in the control frames themselves:
    a store's bytes in its request (``Store.data``), a read's in its answer,
    at most the daemon's ``inline_max``.  One round trip
    and nothing else: no UCX message, so neither side's progress engine
    polls for it (a 4 KiB store over UCX cost twice as much, measured in
    docs/performance.md).  The answer's bytes are checked for their count
    before they are copied (a daemon could lie)."""

    def __init__(self, caller: Caller, limit: int) -> None:
        self._caller, self.limit = caller, limit

    def takes(self, t: Transfer) -> bool:
        if not t.inline or len(t.arrays) != 1:
            return False
        a = t.arrays[0]
        return isinstance(a, np.ndarray) and a.nbytes <= self.limit

    async def send(self, t: Transfer) -> dict[str, Any]:
        (piece,) = _flat(t.arrays)
        return await self._caller.call(t.request.replace(path="inline", data=piece.data))

    async def receive(self, t: Transfer) -> dict[str, Any]:
        (piece,) = _flat(t.arrays)
        result = await self._caller.call(t.request.replace(path="inline"))
        data = result.pop("data", None)
        if not isinstance(data, bytes) or len(data) != piece.nbytes:
            got = len(data) if isinstance(data, bytes) else type(data).__name__
            raise ConnectionLost(f"the daemon answered a read of {piece.nbytes} bytes with "
                                 f"{got}")
        piece[:] = np.frombuffer(data, dtype=np.uint8)
        return result


def _read_exception(fut: asyncio.Future[Any]) -> None:
    """Mark ``fut``'s exception as retrieved (whoever needs it reads it again)."""
    if not fut.cancelled():
        fut.exception()


def _refused(fut: asyncio.Future[dict[str, Any]]) -> bool:
    """Whether an answer future ended in anything but success."""
    return fut.cancelled() or fut.exception() is not None or not fut.result().get("ok")


def _flat(arrays: Sequence[Any]) -> list[np.ndarray]:
    """Each host array as its bytes (a flat uint8 view: they are contiguous)."""
    return [a.reshape(-1).view(np.uint8) if a.dtype != np.uint8 or a.ndim != 1 else a
            for a in arrays]


class UcxClientPath:
    """The bytes travel over the session's UCX endpoint (bound on first use)."""

    def __init__(self, caller: Caller, host: str, port: int, nonce: bytes,
                 transfer_timeout: float, on_expired: Callable[[], None],
                 check_open: Callable[[], None]) -> None:
        self._caller = caller
        self._check_open = check_open
        self._conn = caller.conn
        self._host, self._port, self._nonce = host, port, nonce
        self.transfer_timeout = transfer_timeout
        self._on_expired = on_expired
        self.ep: ucx.DataEndpoint | None = None
        self._lock = asyncio.Lock()

    async def endpoint(self) -> ucx.DataEndpoint:
        """The UCX endpoint, bound on first use (unless the context closed meanwhile)."""
        if self.ep is not None:
            return self.ep
        async with self._lock:
            if self.ep is None:
                self._check_open()
                self.ep = await bind_ucx(self._host, self._port, self._nonce,
                                         self._caller.timeout, self._conn.lost_future())
                if self._conn.lost is not None:  # lost while we bound: do not keep it
                    self.ep.abort()
            return self.ep

    def abort(self) -> None:
        if self.ep is not None:
            self.ep.abort()

    async def close(self) -> None:
        if self.ep is not None:
            await self.ep.close()

    async def send(self, t: Transfer) -> dict[str, Any]:
        """A store-like request: payload run ``i`` goes out on ``run_tag(id, i)``
        at once, while the daemon checks the request (one round trip)."""
        payloads = t.messages()
        ep = await self.endpoint() if payloads else None
        return await self._caller.call(t.request, moves=_UcxMoves(self, ep, payloads, out=True))

    async def receive(self, t: Transfer) -> dict[str, Any]:
        """A read-like request: once the daemon says yes, run ``i`` is received
        straight into ``messages()[i]``; on an error answer nothing was sent."""
        targets = t.messages()
        ep = await self.endpoint() if targets else None
        return await self._caller.call(t.request, moves=_UcxMoves(self, ep, targets, out=False))

    async def transfer(self, coros: Sequence[Awaitable[None]], arrays: Sequence[Any]) -> None:
        """UCX transfers under the daemon's transfer deadline, all awaited even
        when one fails (UCX may touch the arrays until each ends).  Past the
        deadline the context is aborted (``on_expired``: UCX lets go of the
        arrays) and the call fails with CONNECTION_LOST; the daemon does the
        same on its side.  When the control connection is lost (EOF, reset,
        deadline) the wait ends at once, whatever state the transfers are in:
        the endpoint is aborted by then and ``arrays`` stay referenced for the
        orphan grace, in case UCX still holds them."""
        try:
            await ucx.transfer_all(coros, self.transfer_timeout, self._on_expired,
                                   self._conn.lost_future())
        except ucx.Abandoned:
            self._conn.orphan(list(arrays))
            raise


class _UcxMoves:
    """A UCX op's messages beside its answer: a store's go out at once (a
    failure is raised after the answer: the daemon's word comes first); a
    read's are received once the daemon said yes."""

    def __init__(self, path: UcxClientPath, ep: ucx.DataEndpoint | None, arrays: list[Any],
                 out: bool) -> None:
        self._path, self._ep, self._arrays, self._out = path, ep, arrays, out

    async def run(self, req_id: int, fut: asyncio.Future[dict[str, Any]],
                  answer: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
        ep, arrays = self._ep, self._arrays
        if not self._out:
            result = result_of(await answer())
            if ep is not None:
                with ucx_errors("read transfer"):
                    await self._path.transfer([ep.recv(b, run_tag(req_id, i))
                                               for i, b in enumerate(arrays) if b.nbytes], arrays)
            return result
        failed: ConnectionLost | None = None
        if ep is not None:
            try:
                with ucx_errors("payload send"):
                    await self._path.transfer([ep.send(p, run_tag(req_id, i))
                                               for i, p in enumerate(arrays) if p.nbytes], arrays)
            except ConnectionLost as exc:
                failed = exc
        result = result_of(await answer())
        if failed is not None:
            raise failed
        return result


class DataPaths:
    """The session's paths and the one rule that picks one per op."""

    def __init__(self, ucx_path: UcxClientPath, same_host: StagedClientPath | None,
                 inline: InlineClientPath | None = None) -> None:
        self.ucx = ucx_path
        self.same_host = same_host
        self.inline = inline
        self.on_device_memory: Callable[[str], None] = _ignore  # the context notes the place

    def choose(self, place: BufferPlace | None, t: Transfer) -> ClientPath:
        """Host arrays of a host buffer take the same-host path when the
        session has one, else (a plain store or read, small enough) ride in
        the control frames; everything else (GPU arrays, GPU buffers, a
        buffer whose place is not known, big ops) goes over UCX."""
        if place is None or place.gpu:
            return self.ucx
        same = self.same_host
        if same is not None:
            if all(isinstance(a, np.ndarray) for a in t.arrays) and same.takes(t.arrays):
                return same
        elif self.inline is not None and self.inline.takes(t):
            return self.inline
        return self.ucx

    async def run(self, buffer_id: str, place: BufferPlace | None, t: Transfer,
                  receive: bool = False) -> dict[str, Any]:
        """``t`` over the chosen path.  Raises what the daemon answers, TIMEOUT,
        CONNECTION_LOST."""
        path = self.choose(place, t)
        try:
            return await (path.receive(t) if receive else path.send(t))
        except BadRequest as exc:
            if path is self.ucx or exc.details.get("reason") != "device_memory":
                raise
        self.on_device_memory(buffer_id)
        return await (self.ucx.receive(t) if receive else self.ucx.send(t))


def _ignore(buffer_id: str) -> None:
    pass


async def bind_ucx(host: str, port: int, nonce: bytes, timeout: float | None,
                   lost: asyncio.Future[None] | None = None) -> ucx.DataEndpoint:
    """A UCX endpoint to the daemon, bound to this session by its nonce:
    within ``timeout``, and at once CONNECTION_LOST when ``lost`` (the
    control connection) ends first."""
    limit = timeout if timeout else 30.0
    with ucx_errors(f"UCX connection to {host}"):
        ep = await ucx.connect(host, port, timeout=limit)
    expired = False

    def expire() -> None:
        nonlocal expired
        expired = True
        ep.abort()

    ack = np.zeros(1, dtype=np.uint8)
    try:
        with ucx_errors(f"UCX connection to {host}"):
            await ucx.transfer_all([ep.send(np.frombuffer(nonce, dtype=np.uint8),
                                            ucx.BIND_TAG), ep.recv(ack, ucx.BIND_TAG)],
                                   limit, expire, lost)
        if ack[0] != 1:
            raise ConnectionLost("daemon refused to bind the data endpoint")
    except ConnectionLost:
        ep.abort()
        if expired:
            raise Timeout(f"binding the UCX endpoint at {host} timed out") from None
        raise
    except BaseException:
        ep.abort()
        raise
    return ep



"""The data path: how the bytes of a data op travel, chosen per op by one rule.

A session has ``UcxClientPath`` (an endpoint bound to the session by its
nonce, dialled on first use) and at most one of ``StagedClientPath`` (same
host: we copy through the session's staging area, the daemon copies between
it and its arena) and ``InlineClientPath`` (network: a small op's bytes in
its control frames).  ``DataPaths.choose``: host arrays of a host buffer take
the staged or inline path, everything else UCX.  A buffer's device is what
the daemon stated (``BufferPlace``), never guessed; a staged op the daemon
refuses with ``device_memory`` is noted and rerun over UCX.

Every path: keeps each array it may touch referenced until the transport is
done with it (UCX: the orphan grace; staged: the ring thread's hold), ends
every wait at once with CONNECTION_LOST when the control connection is lost,
and names itself in the request (``path``).
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
from rpcbuf.dataplane.devsum import memory_kind


@dataclass(frozen=True, slots=True)
class BufferPlace:
    """Where a buffer lives, as the daemon stated it: routes and checks its bytes."""

    gpu: bool
    checksum_kind: str  # what a plain store into it is verified with


class Transfer(NamedTuple):
    """One data op's bytes, described once for every path.  ``request`` is
    the UCX form; the other paths send a copy naming themselves.  Message
    ``i`` of ``messages()`` travels on ``run_tag(id, i)``; ``inline``: a plain
    store or read, small enough for its frames."""

    request: P.DataRequest
    arrays: Sequence[Any]
    messages: Callable[[], list[Any]]
    inline: bool = False


class ClientPath(Protocol):
    """A way for a data op's bytes: UCX, staged or inline."""

    async def send(self, t: Transfer) -> dict[str, Any]: ...

    async def receive(self, t: Transfer) -> dict[str, Any]: ...


class StagedClientPath:
    """Same host: our bytes meet the daemon's in the session's staging area;
    the daemon never touches our memory.  An op of at most ``staging.SMALL``
    bytes takes a small slot; a bigger one the ring (one op at a time), our
    thread copying chunk ``k + 1`` while the daemon copies chunk ``k``.  A
    slot or ring whose request we stopped waiting for may still be in use:
    it is retired for good (then big ops go over UCX).  Every copy first
    checks the mapping is still there (``_live``)."""

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
        """``nbytes``, once the mapping is known to be there.  Raises
        CONNECTION_LOST."""
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
        """A big op through the ring: the request goes first (the daemon locks
        while we copy); the daemon answers once it is done with the ring."""
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
    """A big staged op's bytes beside its answer: one chunk needs no
    thread; else our thread fills (store) or empties (read) the ring, and
    stops early only on an error answer."""

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
    """``RPCBUF_INLINE=0`` sends every payload over UCX (to test that path)."""
    return os.environ.get("RPCBUF_INLINE", "").strip().lower() not in ("0", "false", "no", "off")


class InlineClientPath:
    """Small host ops of a network session in the control frames (at most
    the daemon's ``inline_max``): one round trip, no UCX message to poll for.
    A read's bytes are checked for their count before they are copied."""

    def __init__(self, caller: Caller, limit: int) -> None:
        self._caller, self.limit = caller, limit

    def takes(self, t: Transfer) -> bool:
        if not t.inline or len(t.arrays) != 1:
            return False
        a = t.arrays[0]
        return memory_kind(a) == "host" and a.nbytes <= self.limit

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
    if not fut.cancelled():
        fut.exception()


def _refused(fut: asyncio.Future[dict[str, Any]]) -> bool:
    return fut.cancelled() or fut.exception() is not None or not fut.result().get("ok")


def _flat(arrays: Sequence[Any]) -> list[np.ndarray]:
    """Each host array as a flat uint8 view (they are contiguous)."""
    return [a.reshape(-1).view(np.uint8) if a.dtype != np.uint8 or a.ndim != 1 else a
            for a in arrays]


class UcxClientPath:
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
        """The endpoint, bound on first use (unless the context closed meanwhile)."""
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
        """Payload run ``i`` goes out on ``run_tag(id, i)`` at once, while the
        daemon checks the request."""
        payloads = t.messages()
        ep = await self.endpoint() if payloads else None
        return await self._caller.call(t.request, moves=_UcxMoves(self, ep, payloads, out=True))

    async def receive(self, t: Transfer) -> dict[str, Any]:
        """Once the daemon says yes, run ``i`` lands in ``messages()[i]``."""
        targets = t.messages()
        ep = await self.endpoint() if targets else None
        return await self._caller.call(t.request, moves=_UcxMoves(self, ep, targets, out=False))

    async def transfer(self, coros: Sequence[Awaitable[None]], arrays: Sequence[Any]) -> None:
        """UCX transfers under the transfer deadline, all awaited even when one
        fails.  Past the deadline the context is aborted; on a lost control
        connection the wait ends at once and ``arrays`` stay referenced for the
        orphan grace.  Raises CONNECTION_LOST."""
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
    def __init__(self, ucx_path: UcxClientPath, same_host: StagedClientPath | None,
                 inline: InlineClientPath | None = None) -> None:
        self.ucx = ucx_path
        self.same_host = same_host
        self.inline = inline
        self.on_device_memory: Callable[[str], None] = _ignore  # the context notes the place

    def choose(self, place: BufferPlace | None, t: Transfer) -> ClientPath:
        if place is None or place.gpu:
            return self.ucx
        same = self.same_host
        if same is not None:
            if all(memory_kind(a) == "host" for a in t.arrays) and same.takes(t.arrays):
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
    """A UCX endpoint bound to this session by its nonce, within
    ``timeout``.  Raises TIMEOUT, CONNECTION_LOST (at once when ``lost`` ends)."""
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



"""The data path: how the bytes of a data op travel, chosen once per session.

A session has one or two ``DataPath`` implementations: ``UcxPath`` (a UCX
endpoint bound to the session by its nonce, dialled on first use on a
same-host session) and, when ``hello`` granted it, ``SameHostPath`` (the
client sends the addresses of its host arrays; the daemon copies between
them and the arena, ``dataplane/cma.py``).  ``DataPaths.choose`` is the one
rule that picks a path per op: the same-host path for host arrays of a host
buffer, UCX for everything else (GPU arrays, GPU buffers).  A buffer's
device is what the daemon stated (``BufferPlace``, from its metadata), never
guessed; the one fallback left, in ``DataPaths.run``, is for a daemon whose
buffer turned out to be device memory after all (it refuses the addresses
with reason ``device_memory`` before touching a byte): noted, and rerun over
UCX.

The ops (``context.py``, ``batches.py``) describe their bytes once, as a
``Transfer``; each path takes what it needs from it.

Checklist for a new path (shared-memory handles, CUDA device-to-device,
RDMA), touching nothing else on the client side:

1. a class here with ``send(t)`` (store-like: the bytes of ``t.arrays``
   leave, the daemon's result comes back once they landed) and
   ``receive(t)`` (read-like: the daemon says yes, then the bytes land in
   ``t.arrays``), each within the call's in-flight slot and timeout
   (``Caller``) and, for the transfer, the daemon's transfer deadline;
2. whatever it adds to the request (addresses, handles, keys) made from
   ``t`` in one place, as ``SameHostPath`` asks ``t.request(True)``;
3. every array the daemon or the transport may touch stays referenced
   until the daemon answered (``Caller.call(hold=...)``) or, when we stop
   waiting, for the orphan grace (``ControlConnection.orphan``);
4. on a lost control connection every wait ends at once with
   CONNECTION_LOST (``conn.lost_future()``);
5. its case in ``DataPaths.choose`` (which buffers and arrays it takes) and
   its ``close``/``abort`` in ``DataPaths``;
6. its counterpart on the daemon (``control/daemon``'s data path).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np

from control.client.connection import Caller, result_of
from control.wire import protocol as P
from control.wire.errors import BadRequest, ConnectionLost, Timeout
from control.wire.runs import run_tag
from dataplane import ucx


@dataclass(frozen=True, slots=True)
class BufferPlace:
    """Where a buffer lives, as the daemon stated it (its metadata, and the
    hello's ``checksum_kinds``): what routes its bytes and checks them."""

    gpu: bool
    checksum_kind: str  # what a plain store into it is verified with


class Transfer(NamedTuple):
    """One data op's bytes, described once for every path.

    ``request(False)``: the request as the network path sends it;
    ``request(True)``: with the addresses of ``arrays``, the host arrays the
    daemon copies from or into on the same-host path; ``messages()``: the
    UCX messages, message ``i`` on ``run_tag(id, i)``.  (A named tuple and
    closures: made per op, so cheap to make.)"""

    request: Callable[[bool], P.Request]
    arrays: Sequence[Any]
    messages: Callable[[], list[Any]]


class DataPath(Protocol):
    """See the module's checklist."""

    async def send(self, t: Transfer) -> dict[str, Any]: ...

    async def receive(self, t: Transfer) -> dict[str, Any]: ...


class SameHostPath:
    """The daemon copies between our host arrays and its arena: the request
    names their addresses, the arrays stay referenced until it answers."""

    def __init__(self, caller: Caller) -> None:
        self._caller = caller

    async def send(self, t: Transfer) -> dict[str, Any]:
        return await self._caller.call(t.request(True), hold=t.arrays)

    receive = send


class UcxPath:
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
        req, caller = t.request(False), self._caller
        left = await caller.take_slot(req.op, None)
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
            result = result_of(await caller.answer(req_id, fut, req.op, left))
            if sent is not None:
                raise ConnectionLost(f"payload send failed: {sent}") from sent
            return result
        finally:
            caller.release_slot()

    async def receive(self, t: Transfer) -> dict[str, Any]:
        """A read-like request: once the daemon says yes, run ``i`` is received
        straight into ``messages()[i]``; on an error answer nothing was sent."""
        targets = t.messages()
        ep = await self.endpoint() if targets else None
        req, caller = t.request(False), self._caller
        left = await caller.take_slot(req.op, None)
        try:
            req_id = self._conn.next_id()
            fut = self._conn.submit(req_id, req)
            result = result_of(await caller.answer(req_id, fut, req.op, left))
            try:
                if ep is not None:
                    await self._transfer([ep.recv(b, run_tag(req_id, i))
                                          for i, b in enumerate(targets) if b.nbytes], targets)
            except ucx.TransferError as exc:
                raise ConnectionLost(f"{req.op} transfer failed: {exc}") from exc
            return result
        finally:
            caller.release_slot()

    async def _transfer(self, coros: Sequence[Awaitable[None]], arrays: Sequence[Any]) -> None:
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


class DataPaths:
    """The session's paths and the one rule that picks one per op."""

    def __init__(self, ucx_path: UcxPath, same_host: SameHostPath | None) -> None:
        self.ucx = ucx_path
        self.same_host = same_host
        self.on_device_memory: Callable[[str], None] = _ignore  # the context notes the place

    def choose(self, place: BufferPlace | None, arrays: Sequence[Any]) -> DataPath:
        """Host arrays of a host buffer take the same-host path when the
        session has one; everything else (GPU arrays, GPU buffers, a buffer
        whose place is not known) goes over UCX."""
        if self.same_host is not None and place is not None and not place.gpu \
                and all(isinstance(a, np.ndarray) for a in arrays):
            return self.same_host
        return self.ucx

    async def run(self, buffer_id: str, place: BufferPlace | None, t: Transfer,
                  receive: bool = False) -> dict[str, Any]:
        """``t`` over the chosen path.  Raises what the daemon answers, TIMEOUT,
        CONNECTION_LOST."""
        path = self.choose(place, t.arrays)
        try:
            return await (path.receive(t) if receive else path.send(t))
        except BadRequest as exc:
            if path is not self.same_host or exc.details.get("reason") != "device_memory":
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
    try:
        ep = await ucx.connect(host, port, timeout=limit)
    except ucx.TransferError as exc:
        raise ConnectionLost(f"UCX connection to {host} failed: {exc}") from exc
    expired = False

    def expire() -> None:
        nonlocal expired
        expired = True
        ep.abort()

    ack = np.zeros(1, dtype=np.uint8)
    try:
        await ucx.transfer_all([ep.send(np.frombuffer(nonce, dtype=np.uint8),
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



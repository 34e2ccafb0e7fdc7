"""The daemon's data paths: how the bytes of a data op travel between a
client and the daemon's memory, behind one small interface, ``DataPath``.

The data pipeline (``pipeline.py``) decides everything else — which buffer,
which ranges, pins and range locks, verification, counters, the audit record
and the answer — and then asks the session's path to move the bytes of a
batch of items (``Items``) into or out of a ``Region`` of daemon memory (a
buffer's slice of its arena, or scratch memory for a wire-fp16 store).  Two
paths exist:

* ``UcxPath``: one UCX message per run (``protocol.plan_runs``: touching
  small items coalesce), tag ``run_tag(req_id, i)``, received straight into
  or sent straight from the arena span;
* ``SameHostPath``: the request carries the client's addresses; the daemon
  copies between them and the region itself (``dataplane/cma.py``), on its
  copy threads (``copypool.py``), never on the event loop.

Both run under the transfer deadline (``transfer_all``): past it the session
is aborted, and a transfer is always waited for to its end, even when its
task is cancelled, because until then it may still touch the region (which
the pipeline keeps locked and pinned meanwhile).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from control.daemon.copypool import CopyPool
from control.daemon.registry import Buffer
from control.wire.errors import BadRequest, ConnectionLost, RpcBufError
from control.wire.runs import plan_runs, run_tag
from dataplane.cma import CmaError, Peer
from dataplane.ucx import DataEndpoint, TransferError, Truncated, transfer_all

log = logging.getLogger("rpcbuf.daemon")
Run = tuple[int, int, int, int]  # offset in the region, nbytes, first item, stop item
# The event loop blocks (GIL released) at most this long for a same-host copy
# of at most CMA_WAIT_BYTES to end on its copy thread, instead of a loop round
# trip (see copypool.CopyPool.wait); it never runs one itself.
CMA_WAIT, CMA_WAIT_BYTES = 300e-6, 256 << 10


class Region:
    """Daemon memory a transfer lands in or leaves from: ``nbytes`` from
    ``base`` of ``memory`` (an arena, or ``Scratch``).  ``address`` is its
    first byte's address in this process (None: device memory)."""

    __slots__ = ("address", "base", "memory")

    def __init__(self, memory: Any, base: int = 0) -> None:
        self.memory = memory
        self.base = base
        addr = getattr(memory, "address", None)
        self.address: int | None = None if addr is None else int(addr) + base

    def view(self, offset: int, nbytes: int) -> Any:
        return self.memory.view(self.base + offset, nbytes)


class Scratch:
    """An array (NumPy or CuPy, uint8) seen as memory a ``Region`` can use."""

    __slots__ = ("address", "array")

    def __init__(self, array: Any) -> None:
        self.array = array
        self.address = array.ctypes.data if isinstance(array, np.ndarray) else None

    def view(self, offset: int, nbytes: int) -> Any:
        return self.array[offset:offset + nbytes]


class Items:
    """The items of one transfer: ``offsets`` (in the region) and ``sizes``,
    ``nbytes`` in all, and on the same-host path the client's ``addrs``.
    Lists for a single item (no NumPy on the 4 KiB path), uint64 arrays for
    a batch.  ``runs`` (the UCX messages) are planned once, when asked for."""

    __slots__ = ("_runs", "addrs", "nbytes", "offsets", "sizes")

    def __init__(self, offsets: np.ndarray | list[int], sizes: np.ndarray | list[int],
                 nbytes: int, addrs: np.ndarray | list[int] | None = None,
                 runs: list[Run] | None = None) -> None:
        self.offsets, self.sizes, self.nbytes, self.addrs = offsets, sizes, nbytes, addrs
        self._runs = runs

    @classmethod
    def one(cls, offset: int, nbytes: int, addr: int | None = None) -> Items:
        """A plain store or read: a batch of one item, one run (tag = request id)."""
        return cls([offset], [nbytes], nbytes, None if addr is None else [addr],
                   [(offset, nbytes, 0, 1)])

    def runs(self) -> list[Run]:
        if self._runs is None:
            self._runs = plan_runs(np.asarray(self.offsets, dtype=np.uint64),
                                     np.asarray(self.sizes, dtype=np.uint64))
        return self._runs

    def __len__(self) -> int:
        return len(self.offsets)


class Landed(Protocol):
    """Told, from the copying threads, that items ``lo:hi`` have landed."""

    def __call__(self, lo: int, hi: int) -> None: ...


class DataPath(Protocol):
    """How one session's bytes travel.  The checklist for a new path (a
    shared-memory memfd path, CUDA device-to-device, RDMA): write one class
    with the members below, and have the session choose it where it chooses
    the others (``Session.path``); nothing else changes — validation, pins,
    locks, verification, counters, audit and answers are the pipeline's.

    1. ``addressed``: whether its requests name client memory (``addr``/
       ``addrs``); the session routes a request to the path whose kind it is.
    2. ``answer_first``: a read's answer leaves before its bytes (UCX: the
       client posts its receives when it sees the answer); else after them.
    3. ``lands_in_parts``: ``receive`` calls ``landed(lo, hi)`` as parts of a
       batch land (a big batch is then hashed while the rest still moves);
       else the pipeline hashes after the transfer.
    4. ``check(buf)``: refuse (BAD_REQUEST, before anything is locked) a
       buffer this path cannot serve (same host: device memory).
    5. ``messages(items)``: how many wire messages the batch takes (answers
       and audit notes say so; 0 for copies).
    6. ``receive``/``send``: move ``items`` into/out of ``region`` under the
       transfer deadline, waiting for every part to end even when one fails
       or the task is cancelled; raise only ``RpcBufError``s (a foreign error
       is translated here, once: truncated payload BAD_REQUEST, broken
       transfer CONNECTION_LOST).
    7. ``drain``: swallow what the client already sent for a store that is
       refused (UCX: 1-byte receives, one per non-empty run) so it never
       hangs and nothing is parked; nothing to do where nothing was sent.
    8. Tests: the pipeline's unit tests (``tests/test_pipeline.py``) run over
       an in-memory path; add the new one to the integration fixtures.
    """

    addressed: bool
    answer_first: bool
    lands_in_parts: bool

    def check(self, buf: Buffer) -> None: ...
    def messages(self, items: Items) -> int: ...
    async def receive(self, req_id: int, region: Region, items: Items,
                      landed: Landed | None = None) -> None: ...
    async def send(self, req_id: int, region: Region, items: Items) -> None: ...
    async def drain(self, req_id: int, items: Items) -> None: ...


class UcxPath:
    """The network path: one UCX message per run, into or out of the region."""

    addressed = False
    answer_first = True
    lands_in_parts = False

    def __init__(self, ep: DataEndpoint, timeout: float, expired: Callable[[], None]) -> None:
        self.ep, self._timeout, self._expired = ep, timeout, expired

    def check(self, buf: Buffer) -> None:
        pass

    def messages(self, items: Items) -> int:
        return len(items.runs())  # as the client plans them (an empty run sends nothing)

    async def receive(self, req_id: int, region: Region, items: Items,
                      landed: Landed | None = None) -> None:
        ep = self.ep
        try:
            await transfer_all([ep.recv(region.view(off, n), run_tag(req_id, i))
                                for i, (off, n, _, _) in enumerate(items.runs()) if n],
                               self._timeout, self._expired)
        except Truncated as exc:
            raise BadRequest("payload is larger than announced") from exc
        except TransferError as exc:
            raise ConnectionLost(f"store transfer failed: {exc}") from exc

    async def send(self, req_id: int, region: Region, items: Items) -> None:
        ep = self.ep
        try:
            await transfer_all([ep.send(region.view(off, n), run_tag(req_id, i))
                                for i, (off, n, _, _) in enumerate(items.runs()) if n],
                               self._timeout, self._expired)
        except TransferError as exc:
            log.warning("read transfer of request %d failed: %s", req_id, exc)
            raise ConnectionLost(f"read transfer failed: {exc}") from exc

    async def drain(self, req_id: int, items: Items) -> None:
        # The client sends only non-empty runs: a 1-byte receive for an empty
        # one would wait for a message that never comes (until the deadline).
        tags = [run_tag(req_id, i) for i, r in enumerate(items.runs()) if r[1]]
        if not tags:
            return
        sink = [np.zeros(1, dtype=np.uint8) for _ in tags]
        try:
            await transfer_all([self.ep.recv(b, t) for b, t in zip(sink, tags, strict=True)],
                               self._timeout, self._expired)
        except TransferError:
            pass  # truncated: drained, as meant (or the endpoint broke: nothing to drain)


class SameHostPath:
    """The same-host path: the daemon copies between the client's addresses
    and the region (``cma.Peer``), on the copy threads.  Host memory only."""

    addressed = True
    answer_first = False
    lands_in_parts = True

    def __init__(self, peer: Peer, copies: CopyPool, tenant: str, *, timeout: float,
                 stop: threading.Event, peer_gone: Callable[[], bool],
                 abort: Callable[[str], None], expired: Callable[[], None],
                 stopped: Callable[[], bool]) -> None:
        """``stop``: set when the session closes (copies stop within a
        chunk); ``peer_gone``: the client closed its connection; ``abort``
        ends the session; ``stopped``: the daemon no longer serves."""
        self.peer, self._copies, self._tenant, self._timeout = peer, copies, tenant, timeout
        self._stop, self._peer_gone, self._abort = stop, peer_gone, abort
        self._expired, self._stopped = expired, stopped

    def check(self, buf: Buffer) -> None:
        if getattr(buf.pool.arena, "address", None) is None:
            raise BadRequest(f"same-host copies serve host buffers; {buf.buffer_id} is on "
                             f"{buf.pool.key}: use the UCX path", {"reason": "device_memory"})

    def messages(self, items: Items) -> int:
        return 0

    async def receive(self, req_id: int, region: Region, items: Items,
                      landed: Landed | None = None) -> None:
        await self._copy(False, region, items, landed)

    async def send(self, req_id: int, region: Region, items: Items) -> None:
        await self._copy(True, region, items)

    async def drain(self, req_id: int, items: Items) -> None:
        pass  # the bytes are still in the client: nothing was sent

    async def _copy(self, write: bool, region: Region, items: Items,
                    landed: Landed | None = None) -> None:
        """A copy (``write``: region -> client), small or big, on the
        daemon's copy threads (bounded, fair between tenants), never on the
        event loop: the client chooses what backs its memory, and pages that
        never arrive (FUSE, userfaultfd) block the copy for good.  Past the
        deadline the session is aborted, the copy stops at its next chunk,
        and a copy stuck inside one system call is written off (its thread
        replaced).  A task cancelled meanwhile still waits for its copy: until
        it returns it may write into the region, which must stay locked and
        pinned (a copy that never returns keeps it so)."""
        # No copy starts once the session is closing or its client closed the
        # connection (a request may have waited long for its range lock; the
        # client keeps its arrays only for a while after that).
        if self._stop.is_set() or self._peer_gone():
            raise ConnectionLost("the session is closing")
        assert region.address is not None and items.addrs is not None  # check() and the ops
        local = _shifted(items.offsets, region.address)
        stop, timeout = self._stop, self._timeout
        ends = time.monotonic() + timeout

        def cancelled() -> bool:
            return stop.is_set() or time.monotonic() > ends

        pool, peer = self._copies, self.peer
        job = pool.submit(self._tenant, peer.write if write else peer.read,
                          local, items.addrs, items.sizes, cancelled, landed)
        if items.nbytes <= CMA_WAIT_BYTES and pool.wait(job, CMA_WAIT):  # a small copy, done
            error = job.future.exception()
            if isinstance(error, CmaError):
                raise self._error(error) from error
            if error is not None:
                raise error
            return
        stuck = asyncio.get_running_loop().call_later(timeout, pool.written_off, job)
        try:
            await transfer_all([asyncio.shield(job.future)], timeout, self._expired)
        except CmaError as exc:
            raise self._error(exc) from exc
        finally:
            stuck.cancel()
            if not job.future.done() and not pool.cancel(job):
                await outlast(job.future, self._stopped)

    def _error(self, exc: CmaError) -> RpcBufError:
        """EFAULT: the client named memory it does not have (BAD_REQUEST, the
        session goes on; part of the range may have been copied).  Anything
        else (the process exited, changed owner, or we were stopped): the
        session ends."""
        if exc.errno == errno.EFAULT:
            return BadRequest("an address range is not mapped (or not writable) in the "
                              "client's memory; part of the range may have been copied",
                              {"reason": "bad_address"})
        self._abort(f"same-host copy failed: {exc.strerror}")
        return ConnectionLost(f"same-host copy failed: {exc.strerror}")


def _shifted(offsets: np.ndarray | Sequence[int], base: int) -> np.ndarray | list[int]:
    if isinstance(offsets, np.ndarray):
        return offsets + np.uint64(base)
    return [o + base for o in offsets]


async def outlast(fut: asyncio.Future[Any], stopping: Callable[[], bool]) -> None:
    """Wait until ``fut`` is done, whatever cancels us meanwhile (then
    re-raise that): memory it may still write into must stay held.  Only a
    daemon that has stopped serving gives up (nothing is allocated any more,
    and a copy stuck for good must not keep the process from exiting)."""
    cancelled = False
    while not fut.done() and not stopping():
        try:
            await asyncio.wait([fut])
        except asyncio.CancelledError:
            if stopping():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError

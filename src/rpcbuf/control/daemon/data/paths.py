"""The daemon's data paths: how one op's bytes travel between a client and
a ``Region`` of daemon memory, behind ``DataPath``.  The pipeline decides
everything else (buffer, ranges, pins, locks, verification, counts, audit,
answer); a path only moves the bytes of a batch of ``TransferItems``:

* ``UcxPath``: one UCX message per run, tag ``run_tag(req_id, i)``, straight
  into or out of the region;
* ``StagedPath``: the bytes are in the session's staging area (daemon shmem
  shared with the local client): small ops copied on the loop, big ones
  streamed through the ring on the copy threads;
* ``InlinePath``: a small op's bytes in its own frames, copied on the loop.

A transfer is always waited for to its end, even when its task is
cancelled: until then it may still touch the region (kept locked and pinned).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from rpcbuf.control.daemon.accounting.registry import Buffer
from rpcbuf.control.ucx_errors import ucx_errors
from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.errors import BadRequest, ConnectionLost
from rpcbuf.control.wire.runs import plan_runs, run_tag
from rpcbuf.dataplane import staging
from rpcbuf.dataplane.arena import Arena
from rpcbuf.dataplane.copypool import CopyPool
from rpcbuf.dataplane.devsum import memory_kind
from rpcbuf.dataplane.ucx import DataEndpoint, TransferError, transfer_all

log = logging.getLogger("rpcbuf.daemon")
Run = tuple[int, int, int, int]  # offset in the region, nbytes, first item, stop item
Landed = Callable[[int, int], None]  # items [lo, hi) have landed (called from copy threads)


class Region:
    """Daemon memory a transfer lands in or leaves from: from ``base`` of
    ``memory``; ``address`` is its first byte here (None: device memory)."""

    __slots__ = ("address", "base", "memory")

    def __init__(self, memory: Arena | Scratch, base: int = 0) -> None:
        self.memory = memory
        self.base = base
        addr = memory.address
        self.address: int | None = None if addr is None else int(addr) + base

    def view(self, offset: int, nbytes: int) -> Any:
        return self.memory.view(self.base + offset, nbytes)


class Scratch:
    """An array (NumPy or CuPy, uint8) seen as memory a ``Region`` can use."""

    __slots__ = ("address", "array")

    def __init__(self, array: Any) -> None:
        self.array = array
        self.address: int | None = array.ctypes.data if memory_kind(array) == "host" else None

    def view(self, offset: int, nbytes: int) -> Any:
        return self.array[offset:offset + nbytes]


class TransferItems:
    """The items of one transfer: ``offsets`` (in the region), ``sizes``,
    ``nbytes`` in all, the request's staging ``stage``; lists for one item
    (no NumPy on the 4 KiB path), uint64 arrays for a batch.  ``runs`` (the
    UCX messages, the order of the bytes when staged) are planned once."""

    __slots__ = ("_runs", "nbytes", "offsets", "sizes", "stage")

    def __init__(self, offsets: np.ndarray | list[int], sizes: np.ndarray | list[int],
                 nbytes: int, stage: int | None = None,
                 runs: list[Run] | None = None) -> None:
        self.offsets, self.sizes, self.nbytes, self.stage = offsets, sizes, nbytes, stage
        self._runs = runs

    @classmethod
    def one(cls, offset: int, nbytes: int, stage: int | None = None) -> TransferItems:
        """A plain store or read: one item, one run."""
        return cls([offset], [nbytes], nbytes, stage, [(offset, nbytes, 0, 1)])

    def runs(self) -> list[Run]:
        if self._runs is None:
            self._runs = plan_runs(np.asarray(self.offsets, dtype=np.uint64),
                                     np.asarray(self.sizes, dtype=np.uint64))
        return self._runs

    def __len__(self) -> int:
        return len(self.offsets)


class DataPath(Protocol):
    """How one session's bytes travel (a new path is one more class of these
    members; the pipeline does the rest).

    * ``addressed``: requests name a staging slot; ``answer_first``: a read
      answers before its bytes move; ``lands_in_parts``: ``receive`` calls
      ``landed(lo, hi)`` as parts land.
    * ``check(buf)`` and ``admit(items)``: BAD_REQUEST, before anything is
      locked, for a buffer or items this path cannot carry.  ``admit`` runs
      once per op, before ``receive``/``send``, and decides what they need.
    * ``receive``/``send``: under the transfer deadline, waiting for every
      part even when one fails or the task is cancelled; raise only
      ``RpcBufError``s.  A move that needs no waiting awaits nothing, so the
      op ends in its first step.
    * ``drain``: swallow what the client already sent for a refused store.
    * ``messages``: wire messages of a batch; ``carried``: what a read's
      answer carries besides its result (inline: ``data``).
    """

    addressed: bool
    answer_first: bool
    lands_in_parts: bool

    def check(self, buf: Buffer) -> None: ...
    def messages(self, items: TransferItems) -> int: ...
    def admit(self, items: TransferItems) -> None: ...
    def carried(self) -> dict[str, Any]: ...
    async def receive(self, req_id: int, region: Region, items: TransferItems,
                      landed: Landed | None = None) -> None: ...
    async def send(self, req_id: int, region: Region, items: TransferItems) -> None: ...
    async def drain(self, req_id: int, items: TransferItems) -> None: ...


class UcxPath:
    """The network path: one UCX message per run, into or out of the region."""

    addressed = False
    answer_first = True
    lands_in_parts = False

    def __init__(self, ep: DataEndpoint, timeout: float, expired: Callable[[], None],
                 posted: Callable[[int], None] = lambda req_id: None) -> None:
        self.ep, self._timeout, self._expired = ep, timeout, expired
        self._posted = posted  # request ``req_id``'s receives are posted (the janitor's)

    def check(self, buf: Buffer) -> None:
        pass

    def messages(self, items: TransferItems) -> int:
        return len(items.runs())  # as the client plans them (an empty run sends nothing)

    def admit(self, items: TransferItems) -> None:
        pass  # what arrives is checked against the posted receives (Truncated)

    def carried(self) -> dict[str, Any]:
        return {}

    async def receive(self, req_id: int, region: Region, items: TransferItems,
                      landed: Landed | None = None) -> None:
        ep = self.ep
        self._posted(req_id)
        with ucx_errors("store transfer", truncated="payload is larger than announced"):
            await transfer_all([ep.recv(region.view(off, n), run_tag(req_id, i))
                                for i, (off, n, _, _) in enumerate(items.runs()) if n],
                               self._timeout, self._expired)

    async def send(self, req_id: int, region: Region, items: TransferItems) -> None:
        ep = self.ep
        try:
            with ucx_errors("read transfer"):
                await transfer_all([ep.send(region.view(off, n), run_tag(req_id, i))
                                    for i, (off, n, _, _) in enumerate(items.runs()) if n],
                                   self._timeout, self._expired)
        except ConnectionLost as exc:
            log.warning("read transfer of request %d failed: %s", req_id, exc)
            raise

    async def drain(self, req_id: int, items: TransferItems) -> None:
        # The client sends only non-empty runs: a 1-byte receive for an empty
        # one would wait for a message that never comes (until the deadline).
        self._posted(req_id)
        tags = [run_tag(req_id, i) for i, r in enumerate(items.runs()) if r[1]]
        if not tags:
            return
        sink = [np.zeros(1, dtype=np.uint8) for _ in tags]
        # Truncated: drained, as meant (or the endpoint broke: nothing to drain);
        # nothing is answered from here, so nothing is translated.
        with contextlib.suppress(TransferError):
            await transfer_all([self.ep.recv(b, t) for b, t in zip(sink, tags, strict=True)],
                               self._timeout, self._expired)


class StagedPath:
    """The same-host path: the bytes are in the session's staging area, the
    daemon's own size-sealed shmem shared with the client, so the daemon never
    touches client memory and nothing the client does can make a copy fault
    or block (a client that stalls only stalls its own op, to the deadline).
    A small slot's op (at most ``staging.SMALL`` bytes), or a ring op of one
    chunk that is there already, is a memcpy on the loop; a bigger ring op
    streams chunk by chunk on the copy threads.  Host memory only."""

    addressed = True
    answer_first = False
    lands_in_parts = True

    def __init__(self, shared: staging.Shared, copies: CopyPool, tenant: str, *,
                 timeout: float, stop: threading.Event, expired: Callable[[], None],
                 stopped: Callable[[], bool]) -> None:
        """``shared``: the staging area (the handle channel unmaps it; a ring
        copy holds it while it runs); ``stop``: set when the session closes;
        ``stopped``: the daemon no longer serves."""
        self._shared, self.area = shared, shared.area
        self._copies, self._tenant, self._timeout = copies, tenant, timeout
        self._stop, self._expired, self._stopped = stop, expired, stopped
        self._ring_busy = False

    def check(self, buf: Buffer) -> None:
        host_only(buf, "the same-host path serves host buffers")

    def messages(self, items: TransferItems) -> int:
        return 0

    async def receive(self, req_id: int, region: Region, items: TransferItems,
                      landed: Landed | None = None) -> None:
        await self._copy(False, region, items, landed)

    async def send(self, req_id: int, region: Region, items: TransferItems) -> None:
        await self._copy(True, region, items)

    async def drain(self, req_id: int, items: TransferItems) -> None:
        pass  # the bytes wait in the staging area: nothing to swallow

    def _pieces(self, region: Region, items: TransferItems) -> list[np.ndarray]:
        return [region.view(off, n) for off, n, _, _ in items.runs() if n]

    def admit(self, items: TransferItems) -> None:
        """BAD_REQUEST for a bad stage (a small slot, or the ring), or too
        much for a small slot; CONNECTION_LOST once the session is closing."""
        stage = items.stage
        if stage is None:
            raise BadRequest("a same-host request names its staging slot (stage)")
        self._open()
        if stage == staging.RING:
            return
        if not 0 <= stage < staging.SMALL_SLOTS:
            raise BadRequest(f"stage {stage} is no staging slot (0..{staging.SMALL_SLOTS - 1}"
                             f" or {staging.RING} for the ring)")
        if items.nbytes > staging.SMALL:
            raise BadRequest(f"{items.nbytes} bytes do not fit a small staging slot "
                             f"({staging.SMALL}); use the ring")

    def _open(self) -> None:
        """CONNECTION_LOST once the session is closing (the area may be unmapped)."""
        if self._stop.is_set() or self._shared.closed:
            raise ConnectionLost("the session is closing")

    def carried(self) -> dict[str, Any]:
        return {}

    def _move(self, out: bool, slot: np.ndarray, region: Region, items: TransferItems,
              landed: Landed | None) -> None:
        """A memcpy between ``slot`` and the region on the loop (``out``: a read)."""
        pieces = self._pieces(region, items)
        if out:
            staging.gather(pieces, slot)
        else:
            staging.scatter(slot, pieces)
        if landed is not None:
            landed(0, len(items))

    async def _copy(self, out: bool, region: Region, items: TransferItems,
                    landed: Landed | None = None) -> None:
        """``out``: region -> staging (a read); else staging -> region."""
        self._open()  # the session may have closed while the op waited for its lock
        area = self.area
        if items.stage != staging.RING:  # a small slot (admit checked it)
            self._move(out, area.small(items.stage or 0, items.nbytes), region, items, landed)
            return
        if self._ring_busy:
            raise BadRequest("this session's staging ring is in use by another request",
                             {"reason": "ring_busy"})
        if items.nbytes <= staging.RING_CHUNK and (out or area.get(staging.PRODUCED)):
            # One chunk, there already (a store: the client put it in place
            # before asking) or taken after our answer (a read): copied here
            # on the loop like a small slot, a memcpy of our own memory below
            # THREAD_BYTES, where a copy thread's hand-off would cost more.
            self._move(out, area.chunk(0), region, items, landed)
            area.put(staging.PRODUCED if out else staging.CONSUMED, 1)
            return
        self._ring_busy = True
        try:
            await self._ring(out, region, items, landed)
        finally:
            self._ring_busy = False

    async def _ring(self, out: bool, region: Region, items: TransferItems,
                    landed: Landed | None) -> None:
        """A ring op on a copy thread, under the deadline; a cancelled task
        still waits for the copy, which writes into the region until it returns."""
        runs = [r for r in items.runs() if r[1]]
        pieces = [region.view(off, n) for off, n, _, _ in runs]
        stop, timeout = self._stop, self._timeout
        deadline = time.monotonic() + timeout
        told = [0]

        def stopped() -> bool:
            return stop.is_set()

        def landed_runs(done: int) -> None:  # runs [0, done) are complete
            if landed is not None and done > told[0]:
                landed(runs[told[0]][2], runs[done - 1][3])
                told[0] = done

        pool, shared = self._copies, self._shared
        shared.hold()  # the mapping stays until the copy returned (or never started)
        try:
            job = pool.submit(self._tenant, self.area.pump, pieces, out, stopped, deadline,
                              landed_runs if landed is not None else None)
        except BaseException:
            shared.let_go()
            raise
        job.future.add_done_callback(lambda _: shared.let_go())
        try:
            await transfer_all([asyncio.shield(job.future)], timeout + 1.0, self._expired)
        except staging.Stopped as exc:
            if stop.is_set():
                raise ConnectionLost("the session is closing") from exc
            raise ConnectionLost(f"same-host transfer stopped: {exc}") from exc
        finally:
            if not job.future.done() and not pool.cancel(job):
                await outlast(job.future, self._stopped)


class InlinePath:
    """One request's bytes in its own frames (``Store.data``, an inline
    read's answer's ``data``): at most ``INLINE_MAX``, copied on the loop;
    host memory only (else BAD_REQUEST ``device_memory``: the client uses UCX)."""

    addressed = True  # nothing is in flight beside the request
    answer_first = False
    lands_in_parts = False

    def __init__(self, data: bytes | None) -> None:
        self._data = data  # a store's payload; None for a read
        self._out: bytes | None = None

    def check(self, buf: Buffer) -> None:
        host_only(buf, "bytes in a frame are for host buffers")

    def messages(self, items: TransferItems) -> int:
        return 0

    def admit(self, items: TransferItems) -> None:
        if items.nbytes > P.INLINE_MAX:
            raise BadRequest(f"at most {P.INLINE_MAX} bytes travel in a frame, not "
                             f"{items.nbytes}")
        if self._data is not None and len(self._data) != items.nbytes:
            raise BadRequest(f"the frame carries {len(self._data)} bytes for a store of "
                             f"{items.nbytes}")

    def _move(self, out: bool, region: Region, items: TransferItems) -> None:
        pieces = [region.view(off, n) for off, n, _, _ in items.runs() if n]
        if out:
            self._out = b"".join(p.tobytes() for p in pieces)  # one piece: no extra copy
        else:
            assert self._data is not None
            staging.scatter(np.frombuffer(self._data, dtype=np.uint8), pieces)

    def carried(self) -> dict[str, Any]:
        return {} if self._out is None else {"data": self._out}

    async def receive(self, req_id: int, region: Region, items: TransferItems,
                      landed: Landed | None = None) -> None:
        self._move(False, region, items)
        if landed is not None:
            landed(0, len(items))

    async def send(self, req_id: int, region: Region, items: TransferItems) -> None:
        self._move(True, region, items)

    async def drain(self, req_id: int, items: TransferItems) -> None:
        pass  # the bytes came in the request's frame: nothing to swallow


def host_only(buf: Buffer, why: str) -> None:
    """BAD_REQUEST ``device_memory`` (the client then uses UCX) for a device buffer."""
    if buf.pool.arena.address is None:
        raise BadRequest(f"{why}; {buf.buffer_id} is on {buf.pool.key}: use the UCX path",
                         {"reason": "device_memory"})


async def outlast(fut: asyncio.Future[Any], stopping: Callable[[], bool]) -> None:
    """Wait until ``fut`` is done, whatever cancels us meanwhile (re-raised
    after): memory it may write into must stay held.  Only a daemon that has
    stopped serving gives up (a stuck copy must not keep it from exiting)."""
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

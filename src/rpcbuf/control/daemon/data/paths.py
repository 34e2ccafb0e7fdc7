"""The daemon's data paths: how the bytes of a data op travel between a
client and the daemon's memory, behind one small interface, ``DataPath``.

The data pipeline (``pipeline.py``) decides everything else — which buffer,
which ranges, pins and range locks, verification, counters, the audit record
and the answer — and then asks the session's path to move the bytes of a
batch of items (``TransferItems``) into or out of a ``Region`` of daemon memory (a
buffer's slice of its arena, or scratch memory for a wire-fp16 store).  Three
paths exist:

* ``UcxPath``: one UCX message per run (``runs.plan_runs``: touching
  small items coalesce), tag ``run_tag(req_id, i)``, received straight into
  or sent straight from the arena span;
* ``StagedPath``: the request names a slot of the session's staging area
  (daemon memory shared with the local client, ``dataplane/staging.py``);
  the daemon copies between it and the region (small ops on the loop, big
  ones streamed through the ring on its copy threads, ``copypool.py``);
* ``InlinePath``: a small op's bytes in its own frames (a network session's
  ``Store.data``, an inline read answer's ``data``), copied on the loop.

The first two run under the transfer deadline (``transfer_all``): past it
the session is aborted, and a transfer is always waited for to its end, even when its
task is cancelled, because until then it may still touch the region (which
the pipeline keeps locked and pinned meanwhile).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from rpcbuf.control.daemon.accounting.copypool import CopyPool
from rpcbuf.control.daemon.accounting.registry import Buffer
from rpcbuf.control.ucx_errors import ucx_errors
from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.errors import BadRequest, ConnectionLost
from rpcbuf.control.wire.runs import plan_runs, run_tag
from rpcbuf.dataplane import staging
from rpcbuf.dataplane.devsum import memory_kind
from rpcbuf.dataplane.ucx import DataEndpoint, TransferError, transfer_all

log = logging.getLogger("rpcbuf.daemon")
Run = tuple[int, int, int, int]  # offset in the region, nbytes, first item, stop item


class Memory(Protocol):
    """What a ``Region`` lies in: an arena (``Arena``), or ``Scratch``."""

    @property
    def address(self) -> int | None: ...  # its first byte in this process (None: device memory)

    def view(self, offset: int, nbytes: int) -> Any: ...


class Region:
    """Daemon memory a transfer lands in or leaves from: from ``base`` of
    ``memory``.  ``address`` is its first byte's address in this process
    (None: device memory)."""

    __slots__ = ("address", "base", "memory")

    def __init__(self, memory: Memory, base: int = 0) -> None:
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
    """The items of one transfer: ``offsets`` (in the region) and ``sizes``,
    ``nbytes`` in all, and on the same-host path the request's staging
    ``stage``.  Lists for a single item (no NumPy on the 4 KiB path), uint64
    arrays for a batch.  ``runs`` (the UCX messages, and the order of the
    bytes in the staging area) are planned once, when asked for."""

    __slots__ = ("_runs", "nbytes", "offsets", "sizes", "stage")

    def __init__(self, offsets: np.ndarray | list[int], sizes: np.ndarray | list[int],
                 nbytes: int, stage: int | None = None,
                 runs: list[Run] | None = None) -> None:
        self.offsets, self.sizes, self.nbytes, self.stage = offsets, sizes, nbytes, stage
        self._runs = runs

    @classmethod
    def one(cls, offset: int, nbytes: int, stage: int | None = None) -> TransferItems:
        """A plain store or read: a batch of one item, one run (tag = request id)."""
        return cls([offset], [nbytes], nbytes, stage, [(offset, nbytes, 0, 1)])

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

    1. ``addressed``: whether its requests name a staging slot (``stage``);
       the session routes a request to the path whose kind it is.
    2. ``answer_first``: a read's answer leaves before its bytes (UCX: the
       client posts its receives when it sees the answer); else after them.
    3. ``lands_in_parts``: ``receive`` calls ``landed(lo, hi)`` as parts of a
       batch land (a big batch is then hashed while the rest still moves);
       else the pipeline hashes after the transfer.
    4. ``check(buf)``: refuse (BAD_REQUEST, before anything is locked) a
       buffer this path cannot serve (same host: device memory, for now).
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
    8. ``admit(items)``: refuse (BAD_REQUEST, before anything is locked)
       items this path cannot carry (a bad staging slot, a frame whose byte
       count is not the request's).
    9. ``carried()``: what a read's answer carries besides its result (the
       inline path: the bytes, ``data``); ``{}`` where they travel apart.
    A move that needs no waiting (a small slot's copy, an inline frame's)
    is done without awaiting anything, so the op ends in its first step
    and the session answers it with no task (``intake.start``): the 4 KiB
    path's largest saving.
    10. Tests: the pipeline's unit tests (``tests/daemon/test_pipeline.py``) run over
       an in-memory path; add the new one to the integration fixtures.
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
        try:
            await transfer_all([self.ep.recv(b, t) for b, t in zip(sink, tags, strict=True)],
                               self._timeout, self._expired)
        except TransferError:
            pass  # truncated: drained, as meant (or the endpoint broke: nothing to drain)


class StagedPath:
    """The same-host path: the client's bytes are in the session's staging
    area (``dataplane/staging.py``), which the daemon made and shares with
    the client; the daemon copies between it and the region.  The daemon
    never touches client memory and needs no rights over the client
    process: the staging area is its own shmem, size-sealed, so nothing the
    client does can make a copy fault or block (a client that stops
    producing or consuming only stalls its own op, until the deadline).

    A small op (``stage`` = a small slot, at most ``staging.SMALL`` bytes)
    is copied right here on the loop: it is a ``memcpy`` of daemon memory;
    so is a ring op of one chunk whose bytes are there (a store the client
    put in place first) or are taken after the answer (a read).
    A ring op (``stage == staging.RING``) streams chunk by chunk on the copy
    threads (``copypool.py``: bounded, fair between tenants), the client
    copying the next chunk while we copy this one.  Host memory only."""

    addressed = True
    answer_first = False
    lands_in_parts = True

    def __init__(self, shared: staging.Shared, copies: CopyPool, tenant: str, *,
                 timeout: float, stop: threading.Event, expired: Callable[[], None],
                 stopped: Callable[[], bool]) -> None:
        """``shared``: the session's staging area (its owner, the handle
        channel, unmaps it; a ring copy holds it while it runs); ``stop``:
        set when the session closes (ring copies stop within a chunk);
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
        """A bad stage is BAD_REQUEST (see ``_small``)."""
        self._small(items)

    def _small(self, items: TransferItems) -> bool:
        """Whether ``items`` go through a small slot (copied right away,
        ``_move``) rather than the ring; a bad stage is BAD_REQUEST."""
        stage = items.stage
        if stage is None:
            raise BadRequest("a same-host request names its staging slot (stage)")
        if self._stop.is_set() or self._shared.closed:
            raise ConnectionLost("the session is closing")
        if stage == staging.RING:
            return False
        if not 0 <= stage < staging.SMALL_SLOTS:
            raise BadRequest(f"stage {stage} is no staging slot (0..{staging.SMALL_SLOTS - 1}"
                             f" or {staging.RING} for the ring)")
        if items.nbytes > staging.SMALL:
            raise BadRequest(f"{items.nbytes} bytes do not fit a small staging slot "
                             f"({staging.SMALL}); use the ring")
        return True

    def carried(self) -> dict[str, Any]:
        return {}

    def _move(self, out: bool, slot: np.ndarray, region: Region, items: TransferItems,
              landed: Landed | None) -> None:
        """A copy between ``slot`` and the region (``out``: region -> slot, a
        read) on the loop: a memcpy of daemon memory, nothing can block it."""
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
        area = self.area
        if self._small(items):
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
        """A ring op on a copy thread, under the deadline; a task cancelled
        meanwhile still waits for its copy, which writes into the region
        (locked and pinned meanwhile) until it returns."""
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
    """A small op's bytes in its own frames (``Store.data``; an inline read's
    answer's ``data``): one request's path, made for it by the session.  At
    most ``INLINE_MAX`` bytes, copied on the loop (a memcpy between the
    frame and the arena); nothing else travels, so nothing is drained.
    Host memory only (a device buffer is BAD_REQUEST ``device_memory``: the
    client sends it over UCX instead)."""

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
        self.admit(items)
        self._move(False, region, items)
        if landed is not None:
            landed(0, len(items))

    async def send(self, req_id: int, region: Region, items: TransferItems) -> None:
        self.admit(items)
        self._move(True, region, items)

    async def drain(self, req_id: int, items: TransferItems) -> None:
        pass  # the bytes came in the request's frame: nothing to swallow


def host_only(buf: Buffer, why: str) -> None:
    """BAD_REQUEST ``device_memory`` (the client then uses UCX) for a device buffer."""
    if buf.pool.arena.address is None:
        raise BadRequest(f"{why}; {buf.buffer_id} is on {buf.pool.key}: use the UCX path",
                         {"reason": "device_memory"})


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

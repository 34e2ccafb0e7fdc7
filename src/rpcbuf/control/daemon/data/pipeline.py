"""The one data pipeline: every op that moves or touches buffer bytes is
described as data, a ``Plan``, and ``Pipeline.run`` takes its steps once,
in this order:

1. pin every buffer (``Held``: a release meanwhile frees the memory only
   when the request ends) and lock its ranges, one grant per buffer in
   buffer-id order (stores exclusive, reads shared: crossing copies cannot
   deadlock); an exclusive lock drops the range's dedup entries, and is BUSY
   on a buffer a local reader has attached;
2. answer first where the path says so (UCX reads);
3. move the bytes;
4. verify and record (``after``), still locked;
5. unlock, count, audit; the session answers with what ``run`` returns.

``run`` awaits only what must be waited for, so a plan that waits for
nothing ends in its first step.  Pins by construction: an async handler
gets each buffer from ``Held.get``, pinned in the same step as the lookup,
so none holds a buffer across an ``await`` unpinned (tests/hardening/
test_bounds.py checks that no ``async def`` uses the plain lookup).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import numpy as np

from rpcbuf.control.daemon.accounting.locks import LockGrant
from rpcbuf.control.daemon.accounting.registry import Buffer, Registry
from rpcbuf.control.daemon.content.index import ContentIndex
from rpcbuf.control.daemon.data.handles import HandleChannel
from rpcbuf.control.daemon.data.paths import DataPath
from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.errors import BadRequest, Busy, NotFound, OutOfMemory, OutOfRange
from rpcbuf.control.wire.units import THREAD_BYTES
from rpcbuf.dataplane.arena import host_memory
from rpcbuf.dataplane.copypool import CopyPool

Range = tuple[int, int]


class Ops(Protocol):
    """What the ops see of their session."""

    registry: Registry
    content: ContentIndex
    sweeps: CopyPool  # the daemon's threads for memory work, shared fairly by tenant
    session_id: str
    handles: HandleChannel | None  # the same-host handle channel, once bound

    @property
    def owner(self) -> str: ...  # the session's tenant (the ops run after hello only)
    def path(self, req: P.DataRequest) -> DataPath: ...
    def count(self, key: str, n: int) -> None: ...
    def audit(self, op: str, buf: Buffer, offset: int = 0, nbytes: int | None = None,
              note: str = "") -> None: ...
    def abort(self, why: str) -> None: ...
    def schedule_expiry(self) -> None: ...  # a buffer with a lease was made


class Held:
    """The buffers one async request uses: each pinned as it is looked up,
    all unpinned when the request ends (``release``)."""

    __slots__ = ("_bufs", "_registry", "_tenant")

    def __init__(self, registry: Registry, tenant: str) -> None:
        self._registry = registry
        self._tenant = tenant
        self._bufs: list[Buffer] = []

    def get(self, buffer_id: str) -> Buffer:
        """The tenant's buffer, pinned until the request ends; NOT_FOUND."""
        buf = self._registry.get(self._tenant, buffer_id)
        self._registry.pin(buf)
        self._bufs.append(buf)
        return buf

    def keep(self, buf: Buffer) -> bool:
        """Pin a buffer found another way; False when it was released already."""
        if buf.released:
            return False
        self._registry.pin(buf)
        self._bufs.append(buf)
        return True

    def release(self) -> None:
        bufs, self._bufs = self._bufs, []
        for buf in reversed(bufs):
            self._registry.unpin(buf)


class Call:
    """One async request as its op sees it: its id, its ``held`` buffers, and
    ``answer_first`` (the session's one answer path, taken early)."""

    __slots__ = ("_answer", "answered", "held", "req_id")

    def __init__(self, req_id: int, held: Held,
                 answer: Callable[[int, dict[str, Any]], None]) -> None:
        self.req_id, self.held, self._answer = req_id, held, answer
        self.answered = False

    def answer_first(self, result: dict[str, Any]) -> None:
        self.answered = True
        self._answer(self.req_id, result)


class Plan:
    """One data op after validation (see the module's steps)."""

    __slots__ = ("after", "answer", "buf", "counter", "early", "exclusive", "forget", "more",
                 "move", "nbytes", "note", "offset", "op", "ranges", "sources")

    def __init__(self, op: str, buf: Buffer, ranges: list[Range], *, exclusive: bool,
                 move: Callable[[], Awaitable[None]], nbytes: int,
                 offset: int | None = None,
                 counter: str | None = None, note: str = "",
                 answer: dict[str, Any] | None = None,
                 after: Callable[[], Awaitable[dict[str, Any]]] | None = None,
                 early: dict[str, Any] | None = None,
                 sources: list[tuple[Buffer, Range]] | None = None,
                 forget: bool = True, more: list[Buffer] | None = None) -> None:
        self.op, self.buf, self.ranges, self.exclusive = op, buf, ranges, exclusive
        self.move, self.nbytes, self.counter, self.note = move, nbytes, counter, note
        self.offset = ranges[0][0] if offset is None else offset  # what the audit says
        self.answer, self.after, self.early = answer, after, early
        self.sources, self.forget = sources, forget
        self.more = more  # more buffers, locked whole as ``buf`` is (a block put's blocks)


class Pipeline:
    """Runs plans for one session (``ops``)."""

    def __init__(self, ops: Ops) -> None:
        self._ops = ops

    async def run(self, call: Call, plan: Plan) -> dict[str, Any]:
        grants = await self.lock(call.held, plan.buf, plan.ranges, plan.exclusive,
                                 plan.sources, plan.forget, plan.more)
        try:
            if plan.early is not None:
                call.answer_first(plan.early)
            await plan.move()
            result = plan.answer if plan.after is None else await plan.after()
        finally:
            unlock(grants)
        return self._done(plan, result)

    def _done(self, plan: Plan, result: dict[str, Any] | None) -> dict[str, Any]:
        ops = self._ops
        if plan.counter is not None:
            ops.count(plan.counter, plan.nbytes)
        ops.audit(plan.op, plan.buf, plan.offset, plan.nbytes, plan.note)
        return {} if result is None else result

    def _granted(self, b: Buffer, rngs: list[Range], excl: bool, forget: bool) -> None:
        """Once granted: an exclusive lock is BUSY on an attached ``b``, else
        drops ``b``'s dedup entries there."""
        if excl and b.attached:  # read in place by a local reader: hands off
            raise Busy(f"buffer {b.buffer_id} is attached (read in place) by "
                       f"{b.attached} reader(s); it cannot change until they detach",
                       {"buffer_id": b.buffer_id, "attached": b.attached})
        if excl and forget:  # these bytes change: dedup must not use them
            self._ops.content.forget(b, rngs)

    async def lock(self, held: Held, buf: Buffer, ranges: list[Range], exclusive: bool,
                   sources: list[tuple[Buffer, Range]] | None = None,
                   forget: bool = True, more: list[Buffer] | None = None,
                   writes: bool = True) -> list[tuple[Buffer, LockGrant]]:
        """Step 1: pin and lock ``ranges`` of ``buf`` and each source range
        (shared), one grant per buffer in buffer-id order, every buffer
        pinned before the first await; ``more`` buffers (pinned by the
        caller) are locked whole.  NOT_FOUND for a buffer released meanwhile
        (its memory is only pinned).  An exclusive lock first gives a clone
        memory of its own (``own``); with ``forget=False`` the op forgets
        and owns itself.  Unlock with ``unlock``."""
        if not sources and not more:  # the common case: one buffer
            groups = [(buf, ranges, exclusive)]
        else:
            by_id: dict[str, tuple[Buffer, list[Range], bool]] = {
                buf.buffer_id: (buf, list(ranges), exclusive)}
            for b in more or ():
                by_id[b.buffer_id] = (b, [(0, b.alloc_size)], exclusive)
            for b, rng in sources or ():
                if b.buffer_id not in by_id:
                    if not held.keep(b):
                        raise NotFound(f"no buffer {b.buffer_id!r}")
                    by_id[b.buffer_id] = (b, [], False)
                by_id[b.buffer_id][1].append(rng)
            groups = [by_id[k] for k in sorted(by_id)]
        grants: list[tuple[Buffer, LockGrant]] = []
        try:
            for b, rngs, excl in groups:
                if b.released:
                    raise NotFound(f"no buffer {b.buffer_id!r}")
                waiting: list[asyncio.Future[None]] = []

                def ready(waiting: list[asyncio.Future[None]] = waiting) -> None:
                    if waiting and not waiting[0].done():
                        waiting[0].set_result(None)

                grant = b.locks.acquire(rngs, excl, ready)
                grants.append((b, grant))
                if not grant.granted:  # ``ready`` fires only from another's release
                    waiting.append(asyncio.get_running_loop().create_future())
                    await waiting[0]
                    if b.released:  # released while we waited: its memory is only pinned
                        raise NotFound(f"no buffer {b.buffer_id!r}")
                self._granted(b, rngs, excl, forget)
                if excl and writes:  # ``writes=False``: the caller marks it (mapops)
                    b.written = True
                if b.mapped is not None:  # written in place: taken back first (mapops)
                    await b.mapped.take_back(b, self._ops.session_id)
            if forget:  # a writer: a buffer sharing memory (a clone) gets its own first
                for b, _, excl in groups:
                    if excl:
                        await self.own(b)
        except BaseException:
            unlock(grants)
            raise
        return grants

    async def in_thread(self, nbytes: int, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, a sweep of ``nbytes``: from ``THREAD_BYTES`` on, the
        tenant's job on the fair ``sweeps`` threads (NumPy and xxhash drop the
        GIL); smaller ones inline, where a thread costs more."""
        if nbytes >= THREAD_BYTES:
            return await self._ops.sweeps.run(self._ops.owner, fn, *args)
        return fn(*args)

    async def own(self, buf: Buffer) -> None:
        """Before the first write into a clone: memory of its own, the same
        bytes, copied once however many writers ask (all wait for it)."""
        host = host_memory(buf.pool.arena)
        if host is None or not host.clones.needs_own(buf.offset):
            return
        task = buf.owning
        if task is None:
            registry = self._ops.registry
            registry.pin(buf)  # now, while the caller's pin holds: ``_own`` unpins it
            task = buf.owning = asyncio.ensure_future(_own(registry, buf,
                                                           self._ops.sweeps))
            task.add_done_callback(_retrieved)  # a failure nobody waits for any more
        await asyncio.shield(task)


def _retrieved(task: asyncio.Future[None]) -> None:
    if not task.cancelled():
        task.exception()  # its waiters got it; asyncio must not log it as lost


async def _own(registry: Registry, buf: Buffer, sweeps: CopyPool) -> None:
    """``Pipeline.own``'s one copy.  Pinned by ``own`` before this task was
    made (the writer that asked may be gone when it starts)."""
    try:
        host = host_memory(buf.pool.arena)  # only host memory shares (``needs_own``)
        assert host is not None
        clones = host.clones
        try:
            fd = await sweeps.run(buf.tenant, clones.copy_out, buf.offset, buf.alloc_size)
        except OSError as exc:
            raise OutOfMemory(f"cannot give buffer {buf.buffer_id} memory of its own: "
                              f"{exc.strerror or exc}", {"reason": "backing"}) from None
        clones.adopt(buf.offset, fd)
    finally:
        buf.owning = None
        registry.unpin(buf)


def unlock(grants: list[tuple[Buffer, LockGrant]]) -> None:
    for b, grant in reversed(grants):
        b.locks.release(grant)


# -- validation shared by the ops ---------------------------------------------------------

def check_range(buf: Buffer, offset: int, nbytes: int) -> None:
    if offset > buf.size or nbytes > buf.size - offset:
        raise OutOfRange(
            f"[{offset}, {offset + nbytes}) is outside buffer of {buf.size} bytes",
            {"offset": offset, "nbytes": nbytes, "size": buf.size},
        )


def check_items(buf: Buffer, offsets: np.ndarray, sizes: np.ndarray,
                disjoint: bool = True) -> None:
    if len(offsets) == 0:
        return
    if (offsets > P.MAX_INT).any() or (sizes > P.MAX_INT).any():
        raise BadRequest("offsets and sizes must be below 2**63")
    ends = offsets + sizes  # no overflow: both < 2**63
    if (ends > buf.size).any():
        i = int(np.argmax(ends > buf.size))
        raise OutOfRange(
            f"item {i} [{offsets[i]}, {ends[i]}) is outside buffer of {buf.size} bytes",
            {"item": i, "offset": int(offsets[i]), "nbytes": int(sizes[i]), "size": buf.size},
        )
    if disjoint and (offsets[1:] < ends[:-1]).any():
        raise BadRequest("batch items must be sorted by offset and must not overlap")
    # Bounded work: a batch moves at most its buffer's size (overlapping
    # reads count each time).  No overflow: each end is <= buf.size < 2**63
    # and there are at most MAX_ITEMS items.
    total = int(sizes.sum())
    if total > buf.size:
        raise BadRequest(f"a batch may move at most its buffer's {buf.size} bytes; these "
                         f"items add up to {total}", {"nbytes": total, "size": buf.size})


def hull(offsets: np.ndarray, sizes: np.ndarray) -> Range:
    """The smallest range covering every item (what a batch locks)."""
    if not len(offsets):
        return (0, 0)
    return int(offsets.min()), int((offsets + sizes).max())



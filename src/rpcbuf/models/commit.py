"""A load's two phases and its revoke over the slot buffers: the PLANNED record
before any tensor is written (PutStart), COMMITTED with the verified checksums
once every slot verified (PutEnd), and ``abort`` releasing what a failed load
created (PutRevoke).  Cleanup runs to its end under cancellation (``settle``)
and waits at most ``CLEANUP_TIMEOUT`` on a node that no longer answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from rpcbuf.control.client.cluster import Cluster, ClusterError
from rpcbuf.control.wire.errors import RpcBufError
from rpcbuf.models.record import COMMITTED, LOAD_TENSOR, read_record
from rpcbuf.models.slots import SlotJob

CLEANUP_TIMEOUT = 10.0  # seconds a failed load's cleanup waits on one node
T = TypeVar("T")


async def settle(aw: Awaitable[T]) -> T:
    """Run ``aw`` to its end even if the caller is cancelled meanwhile (then
    raise CancelledError): cleanup that must not be cut short."""
    task = asyncio.ensure_future(aw)
    cancelled = False
    while not task.done():
        try:
            await asyncio.wait([task])
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return task.result()


async def each_slot(cluster: Cluster, jobs: list[SlotJob],
                    one: Callable[[SlotJob], Awaitable[None]], what: str) -> None:
    """``one(job)`` on every slot at once; when any fails, release what this
    load created, then raise a local error as is, the nodes' as one ``ClusterError``."""
    results = await asyncio.gather(*(one(j) for j in jobs), return_exceptions=True)
    errors: dict[str, RpcBufError] = {}
    other: BaseException | None = None
    for j, r in zip(jobs, results, strict=True):
        if isinstance(r, RpcBufError):
            errors.setdefault(j.endpoint, r)
        elif isinstance(r, BaseException) and other is None:
            other = r  # a local problem (the file): clean up all the same
    if errors or other is not None:
        cleaned = await settle(release_created(cluster, jobs))
        if other is not None:
            raise other
        raise ClusterError.of(what, errors, cleaned=cleaned)


async def start(cluster: Cluster, jobs: list[SlotJob]) -> None:
    """PutStart: every slot's planned record, before any byte changes, unless
    every slot already holds, committed by one load, exactly what this load puts
    there with the checksums known in advance: then no record is written (nothing
    changes, and a record written into a clone would unshare its memory)."""
    if await _unchanged(cluster, jobs):
        for j in jobs:
            j.inherited = True
        return
    await write_records(cluster, jobs, "recording the load's plan")


async def _unchanged(cluster: Cluster, jobs: list[SlotJob]) -> bool:
    loads, found = set(), []
    for j in jobs:
        held, want, rec = j.held, j.expect, j.record
        if held is None or want is None or rec is None or LOAD_TENSOR not in held:
            return False
        layout = j.layout()
        if any(not isinstance(e := held.get(n), dict) or e.get("checksum") != want.get(n)
               or e.get("offset") != layout.get(n) for n in rec.names) \
                or held[LOAD_TENSOR].get("offset") != j.record_offset:
            return False
        try:
            old = await read_record(cluster[j.endpoint], j.buffer_id, held[LOAD_TENSOR])
        except RpcBufError:
            return False
        if old.state != COMMITTED or (old.slots, old.slot, old.names) != \
                (rec.slots, rec.slot, rec.names) \
                or old.checksums != tuple(want[n] for n in rec.names):
            return False
        loads.add(old.load)
        found.append(old)
    if len(loads) != 1:
        return False
    for j, old in zip(jobs, found, strict=True):
        j.record = old
    return True


async def write_records(cluster: Cluster, jobs: list[SlotJob], what: str) -> None:
    """Store each slot's record (checksum-verified) unless ``inherited``."""
    async def one(j: SlotJob) -> None:
        assert j.record is not None
        if j.inherited:
            return
        await cluster[j.endpoint].store_tensors(
            j.buffer_id, {LOAD_TENSOR: j.record.encode()}, offset=j.record_offset,
            verify="checksum")

    await each_slot(cluster, jobs, one, what)


async def commit(cluster: Cluster, jobs: list[SlotJob]) -> None:
    """Call only once every slot has verified its manifest."""
    for j in jobs:
        assert j.record is not None
        if not j.inherited:
            j.record = j.record.committed(j.sums)
    await write_records(cluster, jobs, "committing the load")


async def release_created(cluster: Cluster, jobs: list[SlotJob]) -> dict[str, list[str]]:
    """``{endpoint: names released}`` of this load's unreleased buffers."""
    created = [j for j in jobs if j.created and not j.released]

    async def one(j: SlotJob) -> str | None:
        j.released = True
        try:
            await cluster[j.endpoint].release_buffer(j.buffer_id, timeout=CLEANUP_TIMEOUT)
            return j.buffer_name
        except RpcBufError:
            return None  # that node is gone or the buffer with it

    names = await asyncio.gather(*(one(j) for j in created))
    out: dict[str, list[str]] = {}
    for j, n in zip(created, names, strict=True):
        if n is not None:
            out.setdefault(j.endpoint, []).append(n)
    return out


async def abort(cluster: Cluster, jobs: list[SlotJob]) -> None:
    """Release what a failed or interrupted load created, even when cancelled
    meanwhile, once a request or clone on its way has ended (given up after
    ``CLEANUP_TIMEOUT``: what it made holds no committed record).  Reused buffers
    keep their planned record.  Released by the id this load got, never by name."""
    await settle(_abort(cluster, jobs))


async def _abort(cluster: Cluster, jobs: list[SlotJob]) -> None:
    pending = [j.making for j in jobs if j.making is not None and not j.making.done()]
    if pending:
        _, late = await asyncio.wait(pending, timeout=CLEANUP_TIMEOUT)
        for f in late:
            f.cancel()
    await release_created(cluster, jobs)

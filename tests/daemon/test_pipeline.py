"""The daemon's data pipeline (``control/daemon/data/pipeline.py``, the ops of
``dataops.py``) over an in-memory ``DataPath``: no daemon, no UCX.  The
integration tests run the same ops over the real paths; these pin down the
steps themselves: validation before anything moves, a refused store drained
per non-empty run, pins outliving a release, one count and one audit record
per op, verification, the answer before the bytes where the path says so."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import xxhash

from rpcbuf.control.daemon.accounting.registry import Buffer, Pool, Registry
from rpcbuf.control.daemon.content.index import ContentIndex
from rpcbuf.control.daemon.data.paths import DataPath, Region, TransferItems
from rpcbuf.control.daemon.data.pipeline import Call, Held, Pipeline
from rpcbuf.control.daemon.ops.dataops import DataOps
from rpcbuf.control.daemon.ops.dedupops import DedupHandlers
from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.errors import OutOfRange, VerifyFailed
from rpcbuf.control.wire.runs import plan_runs, run_tag
from rpcbuf.dataplane.arena import HostArena
from rpcbuf.dataplane.copypool import CopyPool

TENANT = "alice"


class MemPath:
    """A data path in memory: the client's payloads by tag (``sent``), what
    it receives by tag (``got``), the tags drained; ``gate`` holds every
    transfer until set."""

    addressed = False
    lands_in_parts = False

    def __init__(self, answer_first: bool = True) -> None:
        self.answer_first = answer_first
        self.sent: dict[Any, bytes] = {}
        self.got: dict[Any, bytes] = {}
        self.drained: list[Any] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.events: list[str] = []
        self.admitted: list[TransferItems] = []
        self.moved: list[TransferItems] = []

    def check(self, buf: Buffer) -> None:
        pass

    def messages(self, items: TransferItems) -> int:
        return len(items.runs())

    def admit(self, items: TransferItems) -> None:
        self.admitted.append(items)  # every transfer is awaited (through the gate)

    def carried(self) -> dict[str, Any]:
        return {}

    async def receive(self, req_id: int, region: Region, items: TransferItems,
                      landed: Any = None) -> None:
        self.moved.append(items)
        await self.gate.wait()
        for i, (off, n, _, _) in enumerate(items.runs()):
            if n:
                region.view(off, n)[:] = np.frombuffer(self.sent[run_tag(req_id, i)], np.uint8)

    async def send(self, req_id: int, region: Region, items: TransferItems) -> None:
        self.events.append("send")
        self.moved.append(items)
        await self.gate.wait()
        for i, (off, n, _, _) in enumerate(items.runs()):
            if n:
                self.got[run_tag(req_id, i)] = region.view(off, n).tobytes()

    async def drain(self, req_id: int, items: TransferItems) -> None:
        self.drained += [run_tag(req_id, i) for i, r in enumerate(items.runs()) if r[1]]


class FakeSession:
    """What the ops see of a session (``pipeline.Ops``), recorded."""

    def __init__(self, registry: Registry, path: MemPath) -> None:
        self.registry = registry
        self.content = ContentIndex()
        self.sweeps = CopyPool(2, name="test-sweep")
        self.session_id = "s-test"
        self._path = path
        self.counts: dict[str, int] = {}
        self.audits: list[tuple[str, str, int, int | None]] = []
        self.aborted: list[str] = []

    @property
    def owner(self) -> str:
        return TENANT

    def path(self, req: Any) -> DataPath:
        return self._path

    def count(self, key: str, n: int) -> None:
        self.counts[key] = self.counts.get(key, 0) + n

    def audit(self, op: str, buf: Buffer, offset: int = 0, nbytes: int | None = None,
              note: str = "") -> None:
        self.audits.append((op, buf.buffer_id, offset, nbytes))

    def abort(self, why: str) -> None:
        self.aborted.append(why)


class Rig:
    def __init__(self, answer_first: bool = True) -> None:
        self.pool = Pool.create(HostArena(1 << 20), "buddy")
        self.registry = Registry([self.pool])
        self.path = MemPath(answer_first)
        self.session = FakeSession(self.registry, self.path)
        pipeline = Pipeline(self.session)
        self.ops = DataOps(self.session, pipeline, DedupHandlers(self.session, pipeline))
        self.answers: list[tuple[int, dict[str, Any]]] = []
        self._ids = 0

    def buffer(self, size: int = 4096) -> Buffer:
        buf = self.registry.try_allocate(TENANT, self.pool, size, session_id="s-test")
        assert buf is not None
        return buf

    def call(self) -> Call:
        self._ids += 1
        return Call(self._ids, Held(self.registry, TENANT),
                    lambda rid, res: self.answers.append((rid, res)))

    def bytes_of(self, buf: Buffer, offset: int, n: int) -> bytes:
        return bytes(self.pool.arena.view(buf.offset + offset, n))


async def run(call: Call, coro: Any) -> Any:
    try:
        return await coro
    finally:
        call.held.release()


async def test_a_store_is_a_batch_of_one_counted_and_audited_once() -> None:
    rig = Rig()
    buf = rig.buffer()
    call = rig.call()
    rig.path.sent[call.req_id] = b"x" * 100  # run 0's tag is the request id itself
    res = await run(call, rig.ops.store(call, P.Store(buf.buffer_id, 10, 100)))
    assert res == {"nbytes": 100}
    assert rig.bytes_of(buf, 10, 100) == b"x" * 100
    assert rig.session.counts == {"bytes_stored": 100}
    assert rig.session.audits == [("store", buf.buffer_id, 10, 100)]
    assert buf.pins == 0 and buf.locks.idle


async def test_each_op_admits_its_items_once_and_moves_those_it_admitted() -> None:
    """The path decides once (``admit``, before anything is locked) and the
    move gets what it decided: the same items, never admitted again."""
    rig = Rig()
    buf = rig.buffer()
    batch = (P.pack_u64(np.array([0, 64], np.uint64)), P.pack_u64(np.array([8, 8], np.uint64)))
    ops = [(lambda c: rig.ops.store(c, P.Store(buf.buffer_id, 0, 32, wire_dtype="float16")),
            [16]),
           (lambda c: rig.ops.store(c, P.Store(buf.buffer_id, 0, 16)), [16]),
           (lambda c: rig.ops.store_batch(c, P.StoreBatch(buf.buffer_id, *batch)), [8, 8]),
           (lambda c: rig.ops.read(c, P.Read(buf.buffer_id, 0, 16)), []),
           (lambda c: rig.ops.read_batch(c, P.ReadBatch(buf.buffer_id, *batch)), [])]
    for op, payloads in ops:
        rig.path.admitted.clear()
        rig.path.moved.clear()
        call = rig.call()
        for i, n in enumerate(payloads):
            rig.path.sent[run_tag(call.req_id, i)] = b"w" * n
        await run(call, op(call))
        assert len(rig.path.admitted) == 1
        assert rig.path.moved == rig.path.admitted


async def test_a_refused_store_drains_its_payload_and_leaves_no_trace() -> None:
    rig = Rig()
    buf = rig.buffer(4096)
    call = rig.call()
    with pytest.raises(OutOfRange):
        await run(call, rig.ops.store(call, P.Store(buf.buffer_id, 4000, 200)))
    assert rig.path.drained == [call.req_id]
    assert rig.session.counts == {} and rig.session.audits == [] and buf.pins == 0


async def test_a_refused_batch_drains_only_the_runs_that_were_sent() -> None:
    """The client sends no message for an empty run: draining one would
    wait for it until the transfer deadline."""
    rig = Rig()
    buf = rig.buffer(4096)
    call = rig.call()
    offsets, sizes = np.array([0, 100, 8000], np.uint64), np.array([0, 50, 10], np.uint64)
    req = P.StoreBatch(buf.buffer_id, P.pack_u64(offsets), P.pack_u64(sizes))
    with pytest.raises(OutOfRange):
        await run(call, rig.ops.store_batch(call, req))
    runs = plan_runs(offsets, sizes)
    assert len(rig.path.drained) == sum(1 for r in runs if r[1]) < len(runs)


async def test_verify_failed_says_what_it_expected_and_counts_no_bytes() -> None:
    rig = Rig()
    buf = rig.buffer()
    call = rig.call()
    rig.path.sent[call.req_id] = b"y" * 64
    req = P.Store(buf.buffer_id, 0, 64, checksum=12345, verify="checksum")
    with pytest.raises(VerifyFailed) as info:
        await run(call, rig.ops.store(call, req))
    assert info.value.details == {"expected": 12345, "kind": "xxh3",
                                  "got": xxhash.xxh3_64_intdigest(b"y" * 64)}
    assert rig.session.counts == {"verify_failures": 1} and rig.session.audits == []
    assert buf.locks.idle


async def test_a_read_answers_before_its_bytes_where_the_path_says_so() -> None:
    for first in (True, False):
        rig = Rig(answer_first=first)
        buf = rig.buffer()
        rig.pool.arena.view(buf.offset, 8)[:] = np.arange(8, dtype=np.uint8)
        rig.path.gate.clear()
        call = rig.call()
        task = asyncio.create_task(run(call, rig.ops.read(call, P.Read(buf.buffer_id, 0, 8))))
        for _ in range(10):
            await asyncio.sleep(0)
        assert rig.path.events == ["send"]
        assert call.answered is first and rig.answers == ([(1, {"nbytes": 8})] if first else [])
        rig.path.gate.set()
        assert await task == {"nbytes": 8}
        assert rig.path.got[1] == bytes(range(8)) and rig.session.counts == {"bytes_read": 8}


async def test_release_during_a_transfer_frees_the_memory_only_at_unpin() -> None:
    rig = Rig()
    buf = rig.buffer()
    rig.path.gate.clear()
    call = rig.call()
    rig.path.sent[call.req_id] = b"z" * 32
    task = asyncio.create_task(run(call, rig.ops.store(call, P.Store(buf.buffer_id, 0, 32))))
    for _ in range(10):
        await asyncio.sleep(0)
    free = rig.pool.allocator.stats().free
    rig.registry.release(buf)
    assert not buf.freed and rig.pool.allocator.stats().free == free  # still pinned
    rig.path.gate.set()
    await task
    assert buf.freed and rig.pool.allocator.stats().free > free


async def test_overlapping_stores_never_interleave() -> None:
    rig = Rig()
    buf = rig.buffer()
    rig.path.gate.clear()
    first, second = rig.call(), rig.call()
    rig.path.sent[first.req_id], rig.path.sent[second.req_id] = b"a" * 64, b"b" * 64
    t1 = asyncio.create_task(run(first, rig.ops.store(first, P.Store(buf.buffer_id, 0, 64))))
    for _ in range(5):
        await asyncio.sleep(0)
    t2 = asyncio.create_task(run(second, rig.ops.store(second, P.Store(buf.buffer_id, 32, 64))))
    for _ in range(5):
        await asyncio.sleep(0)
    assert len(buf.locks.waiting) == 1  # the second waits for the first's range
    rig.path.gate.set()
    await asyncio.gather(t1, t2)
    assert rig.bytes_of(buf, 0, 96) == b"a" * 32 + b"b" * 64


async def test_a_batch_records_its_manifest_with_the_checksums_it_saw() -> None:
    rig = Rig()
    buf = rig.buffer()
    call = rig.call()
    offsets, sizes = np.array([0, 16], np.uint64), np.array([16, 8], np.uint64)
    rig.path.sent[call.req_id] = bytes(range(24))  # the two items touch: one run
    req = P.StoreBatch(buf.buffer_id, P.pack_u64(offsets), P.pack_u64(sizes),
                       names=["w", "b"], kinds=P.pack_u64([0, 1]),
                       kind_dtypes=["float32", "int64"], kind_shapes=[[4], [1]])
    res = await run(call, rig.ops.store_batch(call, req))
    assert res["messages"] == 1 and res["items"] == 2 and res["dropped"] == []
    sums = P.unpack_u64(res["checksums"]).tolist()
    assert sums == [xxhash.xxh3_64_intdigest(bytes(range(16))),
                    xxhash.xxh3_64_intdigest(bytes(range(16, 24)))]
    assert buf.tensors["b"]["checksum"] == sums[1] and buf.manifest_version == 1
    assert rig.session.audits == [("store_batch", buf.buffer_id, 0, 24)]


async def test_copy_and_clear_run_the_same_steps() -> None:
    rig = Rig()
    src, dst = rig.buffer(), rig.buffer()
    rig.pool.arena.view(src.offset, 16)[:] = 7
    call = rig.call()
    req = P.CopyBuffer(src.buffer_id, 0, dst.buffer_id, 100, 16)
    assert await run(call, rig.ops.copy(call, req)) == {"nbytes": 16}
    assert rig.bytes_of(dst, 100, 16) == b"\x07" * 16
    call = rig.call()
    clear = P.ClearBuffer(dst.buffer_id, value=0, offset=100, nbytes=8)
    assert await run(call, rig.ops.clear(call, clear)) == {"nbytes": 8}
    assert rig.bytes_of(dst, 100, 16) == b"\x00" * 8 + b"\x07" * 8
    assert [a[0] for a in rig.session.audits] == ["copy", "clear"]
    assert src.pins == dst.pins == 0 and src.locks.idle and dst.locks.idle


async def test_an_attach_during_an_orphaned_own_gets_the_memfd_the_clone_ends_with(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer into a clone starts its ``own`` (the copy outlives it) and
    goes away, so its exclusive lock goes while the copy still runs; a
    local reader that attaches the clone then must get the memfd the clone
    ends with, not the one it shares with its source: after the copy the
    source no longer shares that one, is written in place, and the
    attached clone's bytes would change under its reader."""
    import mmap
    import os
    import threading

    from rpcbuf.control.daemon.ops.attachops import AttachOps

    rig = Rig()
    arena = rig.pool.arena
    n = 64 * 1024
    src = rig.buffer(n)
    arena.view(src.offset, n)[:] = 1
    pipeline = Pipeline(rig.session)
    call = rig.call()
    meta = await run(call, DedupHandlers(rig.session, pipeline).clone(
        call, P.CloneBuffer(src_id=src.buffer_id)))
    clone = rig.registry.get(TENANT, meta["buffer_id"])
    gate = threading.Event()
    real = arena.clones.copy_out

    def slow(offset: int, nbytes: int) -> int:
        assert gate.wait(10)
        return real(offset, nbytes)

    monkeypatch.setattr(arena.clones, "copy_out", slow)
    call = rig.call()
    rig.path.sent[call.req_id] = b"\x02" * 100
    store = asyncio.ensure_future(run(call, rig.ops.store(call, P.Store(clone.buffer_id, 0,
                                                                        100))))
    for _ in range(200):
        if clone.owning is not None:
            break
        await asyncio.sleep(0.005)
    assert clone.owning is not None
    store.cancel()  # its client went away: the lock goes, the copy goes on
    with pytest.raises(asyncio.CancelledError):
        await store
    assert clone.locks.idle

    class Channel:
        def __init__(self) -> None:
            self.fds: list[int] = []

        async def send(self, req_id: int, size: int, fd: int) -> None:
            self.fds.append(os.dup(fd))

    channel = Channel()
    rig.session.handles = channel  # type: ignore[attr-defined]
    attach = AttachOps(rig.session, pipeline)  # type: ignore[arg-type]
    call = rig.call()
    task = asyncio.ensure_future(run(call, attach.attach(call, P.Attach(clone.buffer_id))))
    await asyncio.sleep(0.05)
    gate.set()
    await asyncio.wait_for(task, 10)
    for _ in range(400):
        if clone.owning is None:
            break
        await asyncio.sleep(0.005)
    assert clone.owning is None
    call = rig.call()
    rig.path.sent[call.req_id] = b"\x03" * n  # the source is written
    await run(call, rig.ops.store(call, P.Store(src.buffer_id, 0, n)))
    assert rig.bytes_of(src, 0, 4) == b"\x03" * 4
    with mmap.mmap(channel.fds[0], n, prot=mmap.PROT_READ) as seen:
        assert seen[:n] == b"\x01" * n  # what the attached clone held, unchanged
    os.close(channel.fds[0])
    attach.detach(P.Detach(clone.buffer_id))
    rig.registry.release(clone)
    rig.registry.release(src)
    assert arena.backed == 0 and rig.pool.allocator.stats().used == 0


async def test_an_own_whose_writer_and_buffer_went_before_it_started_leaves_nothing(
) -> None:
    """``own`` pins the buffer for its copy in the same step as it starts
    it: a writer cancelled at once, with the buffer released meanwhile,
    must not leave a copy task that fails on a freed buffer (its error
    never retrieved, ``owning`` stuck on it)."""
    rig = Rig()
    src = rig.buffer(4096)
    pipeline = Pipeline(rig.session)
    call = rig.call()
    meta = await run(call, DedupHandlers(rig.session, pipeline).clone(
        call, P.CloneBuffer(src_id=src.buffer_id)))
    held = Held(rig.registry, TENANT)
    clone = held.get(meta["buffer_id"])
    writer = asyncio.ensure_future(pipeline.own(clone))
    await asyncio.sleep(0)  # own ran: its copy is a task now, not started yet
    task = clone.owning
    assert task is not None and not task.done()
    writer.cancel()
    rig.registry.release(clone)
    held.release()  # the writer's request ends: its pin goes
    await asyncio.wait([task], timeout=10)
    assert task.done() and task.exception() is None and clone.owning is None
    assert clone.freed and clone.pins == 0  # freed once the copy let go of it
    rig.registry.release(src)
    assert rig.pool.arena.backed == 0 and rig.pool.allocator.stats().used == 0

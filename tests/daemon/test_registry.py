"""The registry's synchronous core: checked, idempotent frees; pins that a
freed buffer cannot take; fair waiting for memory (per-tenant FIFOs served
round-robin, fitting requests pass a stuck head, aging); waiter caps and
waiting bytes against quotas; O(1) cancellation; a renew storm does not grow
the expiry heap.  Real allocators and arenas, no daemon."""

from __future__ import annotations

import time

import pytest

from rpcbuf.control.daemon.accounting import lapsed, registry as R
from rpcbuf.control.daemon.accounting.registry import Pool, Quota, Registry, Waiter
from rpcbuf.control.wire.errors import NotFound, QuotaExceeded
from rpcbuf.dataplane.arena import HostArena

MIB = 1 << 20


def make(size: int = 8 * MIB, **kw: object) -> tuple[Registry, Pool]:
    pool = Pool.create(HostArena(size), "buddy")
    return Registry([pool], **kw), pool  # type: ignore[arg-type]


def waiter(reg: Registry, pool: Pool, tenant: str, size: int,
           got: list[tuple[str, object]]) -> Waiter:
    def done(buf: object, err: object) -> None:
        got.append((tenant, buf if err is None else err))

    w = Waiter(tenant, pool, size, {"name": None, "ttl": None, "session_id": None}, done)
    reg.enqueue(w)
    return w


def test_release_then_unpin_frees_once_and_never_another_owners_block() -> None:
    reg, pool = make()
    a = reg.try_allocate("alice", pool, MIB)
    assert a is not None
    reg.pin(a)
    reg.release(a)
    reg.unpin(a)  # freed here, once
    b = reg.try_allocate("bob", pool, MIB)
    assert b is not None and b.offset == a.offset  # the same block, now bob's
    with pytest.raises(NotFound):
        reg.pin(a)  # a stale reference cannot take a pin any more
    reg.release(a)  # idempotent: nothing happens
    with pytest.raises(RuntimeError):
        reg.unpin(a)  # an unbalanced unpin is a bug, said loudly, bob's block untouched
    assert pool.owners[b.offset] is b
    assert pool.allocator.stats().used == b.alloc_size
    assert reg.tenant_usage()["bytes"] == {("bob", "cpu:0"): b.alloc_size}
    pool.allocator.check_invariants()


def test_a_stuck_head_does_not_block_other_tenants() -> None:
    reg, pool = make(8 * MIB)
    hog = reg.try_allocate("hog", pool, 4 * MIB)
    small = reg.try_allocate("x", pool, 2 * MIB)
    assert hog and small
    got: list[tuple[str, object]] = []
    waiter(reg, pool, "alice", 8 * MIB, got)  # cannot fit while others hold memory
    # bob's small request fits: it is served at once, not queued behind alice
    assert reg.try_allocate("bob", pool, 4096) is not None
    waiter(reg, pool, "carol", 2 * MIB, got)
    reg.release(small)  # 2 MiB free again: carol fits, alice still does not
    assert [t for t, _ in got] == ["carol"]


def test_tenants_are_served_round_robin() -> None:
    reg, pool = make(4 * MIB)
    full = reg.try_allocate("hog", pool, 4 * MIB)
    assert full
    got: list[tuple[str, object]] = []
    for _ in range(3):
        waiter(reg, pool, "alice", MIB, got)
    waiter(reg, pool, "bob", MIB, got)
    reg.release(full)
    assert [t for t, _ in got][:2] in (["alice", "bob"], ["bob", "alice"])


def test_an_aged_head_holds_others_back_only_while_free_memory_would_serve_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An aged head that the free bytes would serve (they only have to come
    together) is passed by nobody, for at most another ``AGING``; one that
    needs memory other tenants hold holds nobody back, and is still served
    first once it fits."""
    reg, pool = make(8 * MIB)
    parts = [reg.try_allocate("hog", pool, 2 * MIB) for _ in range(4)]
    assert all(parts)
    reg.release(parts[1])  # 4 MiB free, in two 2 MiB pieces that are no buddies
    reg.release(parts[3])
    got: list[tuple[str, object]] = []
    waiter(reg, pool, "alice", 4 * MIB, got)
    young = reg.try_allocate("bob", pool, 4096)
    assert young is not None  # young head: passed
    reg.release(young)
    now = time.monotonic()
    monkeypatch.setattr(R.time, "monotonic", lambda: now + R.AGING + 1)
    assert reg.try_allocate("bob", pool, 4096) is None  # aged, and 4 MiB are free
    assert reg.queued_ahead("bob", pool)
    monkeypatch.setattr(R.time, "monotonic", lambda: now + 2 * R.AGING + 1)
    assert reg.try_allocate("bob", pool, 4096) is not None  # held back long enough
    assert not reg.queued_ahead("bob", pool)


def test_an_aged_head_that_needs_others_memory_holds_nobody_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The finding of issue 34 (H2): bob waits for the whole device while
    alice holds some of it.  Aged, he holds nobody back (a request of
    alice's is served at once, and she is never told to wait), and he is
    served first once memory comes free."""
    reg, pool = make(8 * MIB)
    held = reg.try_allocate("alice", pool, 2 * MIB)
    assert held is not None
    got: list[tuple[str, object]] = []
    waiter(reg, pool, "bob", 8 * MIB, got)
    now = time.monotonic()
    monkeypatch.setattr(R.time, "monotonic", lambda: now + R.AGING + 1)
    more = reg.try_allocate("alice", pool, MIB)
    assert more is not None and not reg.queued_ahead("alice", pool)
    reg.release(more)
    reg.release(held)  # the whole device free: bob's, before anyone else's
    assert [t for t, _ in got] == ["bob"]


def test_waiters_are_capped_and_their_bytes_count_against_the_quota() -> None:
    reg, pool = make(8 * MIB, default_quota=Quota(bytes_per_device=4 * MIB))
    full = reg.try_allocate("hog", pool, 4 * MIB)
    other = reg.try_allocate("x", pool, 4 * MIB)
    assert full and other
    got: list[tuple[str, object]] = []
    waiter(reg, pool, "alice", 2 * MIB, got)
    waiter(reg, pool, "alice", 2 * MIB, got)
    with pytest.raises(QuotaExceeded):
        waiter(reg, pool, "alice", 4096, got)  # 4 MiB waiting already: that is her quota
    reg2, pool2 = make(8 * MIB)
    reg2.try_allocate("hog", pool2, 8 * MIB)
    for _ in range(R.MAX_WAITERS):
        waiter(reg2, pool2, "alice", 4096, got)
    with pytest.raises(QuotaExceeded):
        waiter(reg2, pool2, "alice", 4096, got)
    waiter(reg2, pool2, "bob", 4096, got)  # another tenant still gets in line


def test_cancelling_many_waiters_is_fast() -> None:
    reg, pool = make(MIB)
    reg.try_allocate("hog", pool, MIB)
    got: list[tuple[str, object]] = []
    ws = [waiter(reg, pool, f"t{i % 200}", 4096, got) for i in range(200 * R.MAX_WAITERS)]
    t0 = time.perf_counter()
    for w in ws:
        reg.cancel(w)
    elapsed = time.perf_counter() - t0
    assert reg.waiting(pool) == 0 and not got
    assert elapsed < 2.0, f"cancelling {len(ws)} waiters took {elapsed:.1f}s"  # was O(n^2)


def test_renew_storm_does_not_grow_the_expiry_heap() -> None:
    reg, pool = make()
    bufs = [reg.try_allocate("alice", pool, 4096, ttl=60.0) for _ in range(10)]
    for _ in range(20_000):
        for b in bufs:
            assert b is not None
            reg.renew(b, 60.0)
    assert len(reg._leases._heap) <= 2 * 10 + 1024 + 1
    assert reg.next_expiry() is not None


def test_a_lapsed_lease_is_named_to_its_tenant_and_remembered_boundedly(
        monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    reg, pool = make(clock=lambda: now[0])
    buf = reg.try_allocate("alice", pool, 4096, name="w", ttl=5.0)
    assert buf is not None
    now[0] += 6
    assert reg.expire() == [buf]
    for look in (lambda t: reg.get(t, buf.buffer_id), lambda t: reg.by_name(t, "w")):
        with pytest.raises(NotFound, match="lease ran out 1 s ago") as exc:
            look("alice")
        assert exc.value.details == {"reason": "lease_expired", "expired_at": 1005.0}
        with pytest.raises(NotFound) as other:  # another tenant learns nothing
            look("bob")
        assert not other.value.details and "lease" not in other.value.message
    again = reg.try_allocate("alice", pool, 4096, name="w")  # the name, used again
    assert again is not None
    reg.release(again)
    with pytest.raises(NotFound) as plain:  # released, not lapsed: no word of the old lease
        reg.by_name("alice", "w")
    assert not plain.value.details
    monkeypatch.setattr(lapsed, "LAPSED_MAX", 8)
    for i in range(20):
        b = reg.try_allocate("alice", pool, 4096, name=f"n{i}", ttl=1.0)
        assert b is not None
    now[0] += 2
    assert len(reg.expire()) == 20 and len(reg._lapsed._when) == 8


def test_each_buffer_gets_its_own_memory_and_a_failed_backing_leaves_nothing() -> None:
    """Host buffers are page-sized blocks with a memfd each (``back`` at
    allocation, ``unback`` at free); when backing fails (no memory, no
    fds) the request is OUT_OF_MEMORY and nothing is allocated or charged."""
    from rpcbuf.control.wire.errors import OutOfMemory

    reg, pool = make()
    small = reg.try_allocate("alice", pool, 100)
    assert small is not None and small.alloc_size == 4096 and small.offset % 4096 == 0
    assert pool.arena.backed == 1
    real = pool.arena.back

    def failing(offset: int, nbytes: int) -> None:
        raise OSError(24, "Too many open files")

    pool.arena.back = failing  # type: ignore[method-assign]
    used = pool.allocator.stats().used
    with pytest.raises(OutOfMemory) as err:
        reg.try_allocate("alice", pool, 1 << 20)
    assert err.value.details["reason"] == "backing"
    assert pool.allocator.stats().used == used and reg.stats("alice")["buffers"] == 1
    pool.arena.back = real  # type: ignore[method-assign]
    reg.release(small)
    assert pool.arena.backed == 0 and pool.allocator.stats().used == 0


async def test_a_buffer_on_a_kept_block_is_locked_until_it_is_zeroed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A kept block still being zeroed (``HostArena.back`` answers a
    ``Zeroing``): the new buffer is locked exclusively before anyone can
    name it, so every read and write waits; the lock goes and
    ``buf.zeroed`` is done once the zeroer has finished."""
    import asyncio

    from rpcbuf.dataplane import kept as K, zeroer as Z

    monkeypatch.setattr(K, "ZERO_NOW", 4096)
    reg, pool = make()
    pool.arena.kept.limit = 8 * MIB
    queued: list[tuple[int, Z.Zeroing, object]] = []

    class Held:
        def put(self, addr: int, kept: Z.Zeroing, owner: object = None) -> None:
            queued.append((addr, kept, owner))

    pool.arena.kept._zeroer = Held()  # type: ignore[attr-defined]
    a = reg.try_allocate("alice", pool, 2 * MIB, name="secret")
    assert a is not None and a.zeroed is None and a.locks.idle  # fresh memory: nothing held
    pool.arena.view(a.offset, a.alloc_size)[:] = 0x5A
    reg.release(a)
    b = reg.try_allocate("bob", pool, 2 * MIB, name="mine")
    assert b is not None and b.offset == a.offset and pool.arena.kept.reused == 1
    assert b.zeroed is not None and not b.zeroed.done()
    grant = b.locks.acquire([(0, 1)], False)  # a read of bob's new buffer: must wait
    assert not grant.granted
    real = Z.Zeroer()
    for item in queued:
        real.put(*item)
    await asyncio.wait_for(asyncio.shield(b.zeroed), 10)
    assert grant.granted  # the zeroing lock went, the read goes on
    assert not pool.arena.view(b.offset, b.alloc_size).any()
    b.locks.release(grant)
    assert b.locks.idle
    reg.release(b)


def test_a_kept_block_is_handed_out_before_other_free_blocks() -> None:
    """Of the free blocks of a size, the one whose memory is kept (the
    last freed) goes first; the buddy allocator's own pick after these
    frees (and merges) would be another (3 MiB: the test fails without
    the preference)."""
    reg, pool = make()
    pool.arena.kept.limit = MIB  # room for one kept block
    bufs = [reg.try_allocate("alice", pool, MIB) for _ in range(8)]
    assert [b.offset for b in bufs if b] == [i * MIB for i in range(8)]
    for i in (5, 3, 4, 1):
        reg.release(bufs[i])  # each kept, dropping the one before
    assert pool.arena.kept.newest(MIB) == MIB
    again = reg.try_allocate("bob", pool, MIB)
    assert again is not None and again.offset == MIB and pool.arena.kept.reused == 1
    for b in (bufs[0], bufs[2], bufs[6], bufs[7], again):
        reg.release(b)
    pool.allocator.check_invariants()


def test_a_clone_counts_waiting_bytes_and_passes_nobody_a_request_could_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``Registry.clone`` is "quota and names as ``try_allocate``": the
    tenant's waiting bytes count against its quota, a tenant with requests
    waiting is served in order (a clone does not jump its own queue), and
    an aged oldest waiter is passed by nobody, a clone neither (None: the
    op answers OUT_OF_MEMORY, it never waits)."""
    reg, pool = make(8 * MIB, default_quota=Quota(bytes_per_device=4 * MIB))
    src = reg.try_allocate("alice", pool, 2 * MIB)
    assert src is not None
    got: list[tuple[str, object]] = []
    w = waiter(reg, pool, "alice", 2 * MIB, got)  # 2 MiB held + 2 MiB waiting: her quota
    with pytest.raises(QuotaExceeded):
        reg.try_allocate("alice", pool, 2 * MIB)
    with pytest.raises(QuotaExceeded):
        reg.clone(src)  # 2 MiB more would pass it, the waiting bytes counted
    reg.cancel(w)
    reg.release(src)
    assert pool.allocator.stats().used == 0 and not got

    reg, pool = make(8 * MIB)
    src = reg.try_allocate("alice", pool, MIB)
    assert src is not None
    w = waiter(reg, pool, "alice", MIB, got)
    assert reg.try_allocate("alice", pool, MIB) is None  # her requests go in order
    assert reg.clone(src) is None
    reg.cancel(w)
    reg.release(src)

    reg, pool = make(16 * MIB)
    hog = [reg.try_allocate("hog", pool, 2 * MIB) for _ in range(8)]
    for part in hog[1:7:2]:  # 6 MiB free, in 2 MiB pieces
        reg.release(part)  # type: ignore[arg-type]
    src = reg.try_allocate("bob", pool, MIB)
    assert all(hog) and src is not None
    waiter(reg, pool, "alice", 4 * MIB, got)  # the 5 MiB free would serve her
    now = time.monotonic()
    monkeypatch.setattr(R.time, "monotonic", lambda: now + R.AGING + 1)
    assert reg.try_allocate("bob", pool, MIB) is None  # aged head: bob waits
    assert reg.clone(src) is None  # and his clone does not pass it either
    assert pool.allocator.stats().used == 11 * MIB and pool.arena.backed == 6


def test_a_kept_block_needs_no_prefault_and_a_fresh_one_does() -> None:
    """A request on a kept block (zeroed, so every page backed) is answered
    at once: pre-faulting resident pages still walks them all (64-126 ms
    per GiB). A fresh block of that size is pre-faulted first."""
    from rpcbuf.control.daemon.ops.controlops import ControlOps

    reg, pool = make(64 * MIB)
    pool.arena.kept.limit = 16 * MIB
    first = reg.try_allocate("alice", pool, 16 * MIB)
    assert first is not None and not ControlOps.ready_now(first)  # fresh: pre-fault it
    assert not pool.arena.kept.resident(first.offset)
    reg.release(first)  # kept, zeroed at once (the zeroer is a thread: wait for it)
    import time
    deadline = time.monotonic() + 10
    while not pool.arena.kept._kept[first.offset].clean and time.monotonic() < deadline:
        time.sleep(0.01)
    again = reg.try_allocate("bob", pool, 16 * MIB)
    assert again is not None and again.offset == first.offset and again.zeroed is None
    assert pool.arena.kept.resident(again.offset) and ControlOps.ready_now(again)
    reg.release(again)
    assert not pool.arena.kept.resident(again.offset)

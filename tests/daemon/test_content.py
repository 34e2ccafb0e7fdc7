"""The content index's trust rules (``control/daemon/content/index.py``), with no
daemon: an entry is indexed only while no write touched its bytes since the
daemon hashed them, deferred entries included, and whatever the write log
cannot prove is handed back to be hashed again, never indexed on trust."""

from __future__ import annotations

from typing import Any

import pytest

from rpcbuf.control.daemon.accounting.registry import Buffer, Pool, Registry
from rpcbuf.control.daemon.content import index as C
from rpcbuf.control.daemon.content.index import ContentIndex
from rpcbuf.dataplane.arena import HostArena

TENANT = "alice"


class Rig:
    def __init__(self) -> None:
        self.pool = Pool.create(HostArena(1 << 20), "buddy")
        self.registry = Registry([self.pool])
        self.index = ContentIndex()

    def buffer(self, size: int = 4096) -> Buffer:
        buf = self.registry.try_allocate(TENANT, self.pool, size, session_id="s")
        assert buf is not None
        return buf

    def stored(self, buf: Buffer, items: list[tuple[str, int, int]],
               digests: bool = True) -> dict[str, dict[str, Any]]:
        """Record ``(name, offset, nbytes)`` entries as ``store_batch`` does
        (digest = 1000 + offset, checksum = offset) and defer them."""
        manifest = {n: {"dtype": "|u1", "shape": [z], "offset": o, "nbytes": z, "checksum": o}
                    for n, o, z in items}
        buf.tensors.update(manifest)
        self.index.defer(buf, manifest, [1000 + o for _, o, _ in items] if digests else None)
        return manifest

    def found(self, offset: int, nbytes: int) -> bool:
        return self.index.lookup(TENANT, 1000 + offset, nbytes, offset) is not None


ITEMS = [("a", 0, 100), ("b", 256, 100), ("c", 512, 100)]


def test_unwritten_deferred_entries_are_indexed_on_trust_and_the_log_goes() -> None:
    rig = Rig()
    buf = rig.buffer()
    rig.stored(buf, ITEMS)
    rig.index.forget(buf, [(1024, 2048)])  # a write elsewhere in the buffer
    assert rig.index.index_deferred(TENANT) == []  # nothing to hash again
    assert all(rig.found(o, z) for _, o, z in ITEMS)
    st = rig.index.stats()
    assert st["deferred_trusted"] == 3 and st["deferred"] == 0 and st["write_logs"] == 0


@pytest.mark.parametrize("write", [(0, 1), (99, 100), (50, 300), (0, 4096)])
def test_a_write_over_a_deferred_entry_keeps_it_out(write: tuple[int, int]) -> None:
    rig = Rig()
    buf = rig.buffer()
    rig.stored(buf, ITEMS)
    rig.index.forget(buf, [write])
    assert rig.index.index_deferred(TENANT) == []
    a, b = write
    for _, o, z in ITEMS:
        assert rig.found(o, z) is not (o < b and a < o + z), (o, write)


def test_a_write_after_indexing_drops_the_entry() -> None:
    rig = Rig()
    buf = rig.buffer()
    rig.stored(buf, ITEMS)
    rig.index.index_deferred(TENANT)
    rig.index.forget(buf, [(300, 301)])
    assert not rig.found(256, 100) and rig.found(0, 100) and rig.found(512, 100)


def test_only_writes_after_the_hash_count() -> None:
    """A range written, then stored again: the old entry is stale, the new one
    (hashed after that write) is trusted."""
    rig = Rig()
    buf = rig.buffer()
    old = rig.stored(buf, [("a", 0, 100)])
    rig.index.forget(buf, [(0, 100)])  # the next store's lock
    buf.tensors.pop("a")
    rig.stored(buf, [("a2", 0, 100)])
    assert rig.index.index_deferred(TENANT) == []
    assert rig.found(0, 100) and rig.index.stats()["deferred_trusted"] == 1
    assert old["a"] is not buf.tensors.get("a2")


def test_an_overflowed_log_proves_nothing_so_the_entries_are_hashed_again() -> None:
    rig = Rig()
    buf = rig.buffer()
    rig.stored(buf, ITEMS)
    for k in range(C.WRITE_LOG + 1):  # none of them touches an entry
        rig.index.forget(buf, [(2048 + k, 2049 + k)])
    again = rig.index.index_deferred(TENANT)
    assert [(b, sorted(m)) for b, m in again] == [(buf, ["a", "b", "c"])]
    assert not any(rig.found(o, z) for _, o, z in ITEMS)


def test_entries_without_digests_are_hashed_again() -> None:
    rig = Rig()
    buf = rig.buffer()
    rig.stored(buf, ITEMS, digests=False)
    assert [sorted(m) for _, m in rig.index.index_deferred(TENANT)] == [["a", "b", "c"]]
    assert not rig.found(0, 100)


def test_replaced_or_released_entries_are_neither_indexed_nor_hashed() -> None:
    rig = Rig()
    buf, gone = rig.buffer(), rig.buffer()
    rig.stored(buf, ITEMS)
    buf.tensors["b"] = dict(buf.tensors["b"])  # another entry under that name now
    rig.stored(gone, [("x", 0, 100)])
    rig.registry.release(gone)
    assert rig.index.index_deferred(TENANT) == []
    assert rig.found(0, 100) and not rig.found(256, 100)
    assert len(rig.index) == 2


def test_an_untrusted_buffer_is_never_indexed_and_leaves_the_index() -> None:
    rig = Rig()
    buf = rig.buffer()
    rig.stored(buf, ITEMS)
    rig.index.index_deferred(TENANT)
    assert rig.found(0, 100)
    buf.trusted = False  # e.g. a writable mapping was handed out
    assert not rig.found(0, 100)
    assert rig.index.add(buf, 0, 100, 1000, 0) is None
    rig.stored(buf, [("d", 1024, 100)])
    assert rig.index.index_deferred(TENANT) == [] and not rig.found(1024, 100)


def test_too_many_write_logs_drop_the_oldest_whose_entries_then_rehash(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(C, "MAX_LOGGED", 2)
    rig = Rig()
    bufs = [rig.buffer() for _ in range(3)]
    for buf in bufs:
        rig.stored(buf, [("a", 0, 100)])
    assert rig.index.stats()["write_logs"] == 2
    rig.index.forget(bufs[0], [(0, 100)])  # not logged any more: must not be trusted
    again = rig.index.index_deferred(TENANT)
    assert [b for b, _ in again] == [bufs[0]]
    assert rig.index.stats()["deferred_trusted"] == 2 and rig.index.stats()["write_logs"] == 0


def test_the_deferred_queue_is_bounded_and_frees_its_logs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(C, "MAX_DEFERRED", 3)
    rig = Rig()
    bufs = [rig.buffer() for _ in range(5)]
    for buf in bufs:
        rig.stored(buf, [("a", 0, 100)])
    st = rig.index.stats()
    assert st["deferred"] == 3 and st["write_logs"] == 3
    rig.index.index_deferred(TENANT)
    assert rig.index.stats()["write_logs"] == 0 and len(rig.index) == 3


def test_one_tenant_never_indexes_anothers_batches() -> None:
    rig = Rig()
    buf = rig.buffer()
    rig.stored(buf, ITEMS)
    assert rig.index.index_deferred("mallory") == []
    assert len(rig.index) == 0 and rig.index.stats()["deferred"] == 1


def test_places_of_released_buffers_go_before_live_ones() -> None:
    """Past ``MAX_LOCATIONS`` places of one hash, the index drops places in
    released buffers first; only with none left does the oldest live one go."""
    rig = Rig()
    rig.pool.arena.kept.limit = 0
    bufs = [rig.buffer() for _ in range(C.MAX_LOCATIONS)]
    for b in bufs:
        rig.index.add(b, 0, 100, 7, 1)
    for b in bufs[1:4]:
        rig.registry.release(b)
    newer = rig.buffer()
    rig.index.add(newer, 0, 100, 7, 1)
    places = {loc.buf.buffer_id for loc in rig.index._tenants[TENANT][7]}
    assert bufs[0].buffer_id in places and newer.buffer_id in places
    assert not places & {b.buffer_id for b in bufs[1:4]}
    for _ in range(4):  # now all live: each new one drops the oldest
        rig.index.add(rig.buffer(), 0, 100, 7, 1)
    places = {loc.buf.buffer_id for loc in rig.index._tenants[TENANT][7]}
    assert bufs[0].buffer_id not in places and len(places) == C.MAX_LOCATIONS

"""Small ops without a UCX message or a task: a network session's small
stores and reads carry their bytes in their control frames (``Store.data``,
a read naming ``path="inline"``), and a small same-host store or read whose range is free is
served on the spot (its op ends in its first step: ``inflight.start``).  Real
daemons; the hostile cases speak the protocol by hand.
"""

from __future__ import annotations

import numpy as np
import pytest

import rpcbuf
from conftest import DaemonProc, pool_free, wait_free
from hardening.rawwire import Raw
from rpcbuf.control.wire import protocol as P


@pytest.fixture(autouse=True)
def _inline_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RPCBUF_INLINE", raising=False)


async def test_small_ops_of_a_network_session_ride_in_their_frames(daemon: DaemonProc) -> None:
    start = await pool_free(daemon)
    async with daemon.connect(same_host=False) as c:
        assert not c.same_host and c.hello["inline_max"] == P.INLINE_MAX
        bid = await c.request_buffer(1 << 20)
        over_ucx = _count_ucx(c)
        rng = np.random.default_rng(5)
        for n in (0, 1, 4096, P.INLINE_MAX):
            data = rng.integers(0, 256, n, dtype=np.uint8)
            await c.store_tensor(bid, data, offset=3, verify="checksum")
            out = np.empty(n, np.uint8)
            assert np.array_equal(await c.read_buffer(bid, 3, n, out=out), data), n
        # A float32 tensor, a read into a bigger ``out`` (its head is filled).
        t = np.linspace(0, 1, 1000, dtype=np.float32)
        await c.store_tensor(bid, t, offset=8192)
        back = np.zeros(2000, np.float32)
        await c.read_buffer(bid, 8192, t.nbytes, out=back)
        assert np.array_equal(back[:1000], t) and not back[1000:].any()
        assert over_ucx == []  # not one op over UCX so far
        big = rng.integers(0, 256, P.INLINE_MAX + 1, dtype=np.uint8)
        await c.store_tensor(bid, big)  # over the limit: a UCX message
        assert np.array_equal(await c.read_buffer(bid, 0, big.nbytes), big)
        assert over_ucx == ["send", "receive"]
        await c.release_buffer(bid)
    assert await wait_free(daemon, start) == start


async def test_inline_can_be_turned_off(daemon: DaemonProc,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RPCBUF_INLINE", "0")
    async with daemon.connect(same_host=False) as c:
        bid = await c.request_buffer(4096)
        data = np.arange(4096, dtype=np.uint32).view(np.uint8)[:4096]
        over_ucx = _count_ucx(c)
        await c.store_tensor(bid, data)
        assert np.array_equal(await c.read_buffer(bid, 0, 4096), data)
        assert over_ucx == ["send", "receive"]  # the payloads went as UCX messages
        await c.release_buffer(bid)


def _count_ucx(c: rpcbuf.RpcContext) -> list[str]:
    """The ops that go over the context's UCX path from now on, by name."""
    ucx, seen = c._paths.ucx, []

    def counting(name: str):  # type: ignore[no-untyped-def]
        op = getattr(ucx, name)

        def counted(t):  # type: ignore[no-untyped-def]
            seen.append(name)
            return op(t)
        return counted

    for name in ("send", "receive"):
        setattr(ucx, name, counting(name))
    return seen


def _hello(daemon: DaemonProc, tenant: str = "alice") -> Raw:
    raw = Raw(daemon.addr)
    answer = raw.call("hello", token=daemon.token(tenant), version=P.PROTOCOL_VERSION)
    assert answer["ok"], answer
    return raw


async def test_hostile_inline_requests_are_refused_and_leave_no_trace(
        daemon: DaemonProc) -> None:
    async with daemon.connect(same_host=False) as c:
        bid = await c.request_buffer(8192)
        before = np.arange(8192, dtype=np.uint64).view(np.uint8)[:8192].copy()
        await c.store_tensor(bid, before)
        meta = await c.get_buffer_meta(bid)
        raw = _hello(daemon)
        try:
            cases = [
                ({"nbytes": 10, "data": b"x" * 9}, "BAD_REQUEST"),  # fewer bytes than said
                ({"nbytes": 10, "data": b"x" * 11}, "BAD_REQUEST"),  # more
                ({"nbytes": 10, "data": "x" * 10}, "BAD_REQUEST"),  # not bytes
                ({"nbytes": P.INLINE_MAX + 1, "data": b"x" * (P.INLINE_MAX + 1)},
                 "BAD_REQUEST"),  # over the limit
                ({"nbytes": 4, "data": b"xxxx", "stage": 0}, "BAD_REQUEST"),  # both ways
                ({"nbytes": 4, "data": b"xxxx", "path": "ucx"}, "BAD_REQUEST"),  # off its path
                ({"nbytes": 4}, "BAD_REQUEST"),  # path "inline", no bytes
                ({"nbytes": 4, "data": b"xxxx", "offset": 8190}, "OUT_OF_RANGE"),
                ({"nbytes": 4, "data": b"xxxx", "buffer_id": "nope"}, "NOT_FOUND"),
            ]
            for fields, code in cases:
                req = {"buffer_id": bid, "offset": 0, "path": "inline", **fields}
                answer = raw.call("store", **req)
                assert not answer["ok"] and answer["error"]["code"] == code, (fields, answer)
            for fields, code in [({"nbytes": P.INLINE_MAX + 1}, "BAD_REQUEST"),
                                 ({"nbytes": 4, "offset": 8190}, "OUT_OF_RANGE"),
                                 ({"nbytes": 4, "stage": 0}, "BAD_REQUEST"),
                                 ({"nbytes": 4, "path": "yes"}, "BAD_REQUEST")]:
                answer = raw.call("read", **{"buffer_id": bid, "offset": 0, "path": "inline",
                                             **fields})
                assert not answer["ok"] and answer["error"]["code"] == code, (fields, answer)
            # Another tenant's buffer does not exist for bob, either way.
            bob = _hello(daemon, "bob")
            try:
                answer = bob.call("store", buffer_id=bid, offset=0, nbytes=4, data=b"evil",
                                  path="inline")
                assert answer["error"]["code"] == "NOT_FOUND"
                answer = bob.call("read", buffer_id=bid, offset=0, nbytes=4, path="inline")
                assert answer["error"]["code"] == "NOT_FOUND"
            finally:
                bob.sock.close()
            # The session is fine and the bytes are what they were.
            ok = raw.call("read", buffer_id=bid, offset=16, nbytes=8, path="inline")
            assert ok["ok"] and ok["result"]["data"] == before[16:24].tobytes()
        finally:
            raw.sock.close()
        assert np.array_equal(await c.read_buffer(bid, 0, 8192), before)
        assert (await c.get_buffer_meta(bid))["tensors"] == meta["tensors"]
        await c.release_buffer(bid)


async def test_small_ops_keep_their_turn_behind_earlier_requests(daemon: DaemonProc) -> None:
    """A small store served on the spot never overtakes a request that came
    before it and runs as a task: sent in one write, a clear then a store of
    the same range end with the store's bytes (locks taken in arrival order)."""
    from hardening.rawwire import frame

    async with daemon.connect(same_host=False) as c:
        bid = await c.request_buffer(1 << 20)
        raw = _hello(daemon)
        try:
            for value in (5, 6, 7):
                raw.send(frame({"op": "clear_buffer", "id": 100 + value, "buffer_id": bid,
                                "value": 1}) +
                         frame({"op": "store", "id": 200 + value, "buffer_id": bid,
                                "offset": 0, "nbytes": 4, "data": bytes([value] * 4),
                                "path": "inline"}))
                answers = [raw.recv(), raw.recv()]
                assert all(a is not None and a["ok"] for a in answers), answers
                got = raw.call("read", buffer_id=bid, offset=0, nbytes=8, path="inline")
                assert got["result"]["data"] == bytes([value] * 4 + [1] * 4), value
        finally:
            raw.sock.close()
        await c.release_buffer(bid)


@pytest.mark.both_paths
async def test_small_ops_are_audited_and_refused_on_attached_buffers(
        daemon: DaemonProc) -> None:
    async with daemon.connect() as c:
        bid = await c.request_buffer(4096)
        await c.store_tensor(bid, np.ones(64, np.uint8))
        if c.same_host:
            async with c.attach(bid):
                with pytest.raises(rpcbuf.Busy):
                    await c.store_tensor(bid, np.zeros(64, np.uint8))
                assert (await c.read_buffer(bid, 0, 64) == 1).all()  # reads go on
        await c.release_buffer(bid)
    log = daemon.log()
    assert "op=store tenant=alice" in log and f"buffer={bid}" in log


def test_requests_after_hello_are_read_as_they_come(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """After hello the session reads its frames as they arrive (no reading
    task): split anywhere they still parse, and at ``--max-inflight`` tasks
    it reads no further until one ends (a ping behind two waiting requests
    is answered only after one of them)."""
    from hardening.rawwire import frame

    d = daemon_factory("--device", "cpu:16MiB", "--max-inflight", "2")
    raw = _hello(d)
    try:
        pings = b"".join(frame({"op": "ping", "id": i}) for i in range(1, 21))
        for i in range(0, len(pings), 7):  # 7-byte pieces: frames split at every place
            raw.send(pings[i:i + 7])
        got = sorted(raw.recv()["id"] for _ in range(20))  # type: ignore[index]
        assert got == list(range(1, 21))
        full = raw.call("request_buffer", size=16 << 20)
        assert full["ok"], full
        raw.send(b"".join(frame({"op": "request_buffer", "id": 100 + i, "size": 1 << 20,
                                 "timeout": 1.0}) for i in range(3))
                 + frame({"op": "ping", "id": 200}))
        order = []
        for _ in range(4):
            msg = raw.recv()
            assert msg is not None
            order.append(msg["id"])
        assert order.index(200) >= 1, order  # the ping waited for a slot
        assert sorted(order) == [100, 101, 102, 200]
    finally:
        raw.sock.close()


async def test_a_small_frame_limit_lowers_inline_max(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """``--max-frame`` below 64 KiB: the daemon offers only what its frames
    hold, and a store bigger than that goes over UCX, not into a frame it
    would refuse."""
    d = daemon_factory("--device", "cpu:16MiB", "--max-frame", "16KiB")
    async with d.connect(same_host=False) as c:
        assert c.hello["inline_max"] == P.inline_max(16 << 10) == (16 << 10) - P.INLINE_ROOM
        over_ucx = _count_ucx(c)
        bid = await c.request_buffer(1 << 20)
        for n in (4096, 15 << 10, 32 << 10):
            data = np.full(n, n % 251, np.uint8)
            await c.store_tensor(bid, data)
            assert np.array_equal(await c.read_buffer(bid, 0, n), data)
        assert over_ucx == ["send", "receive"]  # only the 32 KiB one
        assert P.inline_max(100) == 0


def test_a_bad_inline_store_behind_a_task_is_refused_before_its_lock(
        daemon: DaemonProc) -> None:
    """Behind an earlier task the store runs as a task itself: its byte
    count is still checked before anything is locked, and nothing changes."""
    from hardening.rawwire import frame

    raw = _hello(daemon)
    try:
        bid = raw.call("request_buffer", size=8192)["result"]["buffer_id"]
        assert raw.call("store", buffer_id=bid, offset=0, nbytes=4, data=b"good",
                        path="inline")["ok"]
        raw.send(frame({"op": "clear_buffer", "id": 500, "buffer_id": bid, "offset": 4096,
                        "nbytes": 4096, "value": 3})
                 + frame({"op": "store", "id": 501, "buffer_id": bid, "offset": 0,
                          "nbytes": 4, "data": b"bad", "path": "inline"}))
        answers = {m["id"]: m for m in (raw.recv(), raw.recv()) if m is not None}
        assert answers[500]["ok"]
        assert answers[501]["error"]["code"] == "BAD_REQUEST", answers[501]
        got = raw.call("read", buffer_id=bid, offset=0, nbytes=4, path="inline")
        assert got["result"]["data"] == b"good"
        assert raw.call("release", buffer_id=bid)["ok"]
    finally:
        raw.sock.close()

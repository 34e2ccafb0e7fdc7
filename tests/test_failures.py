"""Bad input gets a clear error, never a crash; nothing is written or lost."""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any

import msgpack
import numpy as np
import pytest

import rpcbuf
from hardening.rawwire import Raw
from rpcbuf.control.wire import protocol as P

pytestmark = pytest.mark.both_paths  # the same-host and the UCX data path


async def test_out_of_range_store_writes_nothing(ctx: rpcbuf.RpcContext) -> None:
    buf = await ctx.request_buffer(4096)
    await ctx.store_tensor(buf, np.full(4096, 9, np.uint8))
    for offset, n in [(4000, 200), (4097, 1), (2**63 - 1, 1), (0, 4097)]:
        with pytest.raises(rpcbuf.OutOfRange) as info:
            await ctx.store_tensor(buf, np.zeros(n, np.uint8), offset=offset)
        assert info.value.details["size"] == 4096
    big = np.zeros(8 << 20, np.uint8)  # refused rendezvous payload: drained, never parked
    with pytest.raises(rpcbuf.OutOfRange):
        await ctx.store_tensor(buf, big, offset=1)
    assert (await ctx.read_buffer(buf) == 9).all()  # nothing landed, connection usable
    with pytest.raises(rpcbuf.OutOfRange):
        await ctx.read_buffer(buf, 4000, 200)
    with pytest.raises(rpcbuf.OutOfRange):
        await ctx.read_buffer(buf, 5000, 0)
    assert (await ctx.read_buffer(buf, 4000, 96) == 9).all()
    await ctx.release_buffer(buf)


async def test_unknown_and_released_buffers(ctx: rpcbuf.RpcContext) -> None:
    with pytest.raises(rpcbuf.NotFound):
        await ctx.get_buffer_meta("b-doesnotexist")
    with pytest.raises(rpcbuf.NotFound):
        await ctx.store_tensor("b-doesnotexist", np.zeros(10 << 20, np.uint8))
    buf = await ctx.request_buffer(100)
    await ctx.release_buffer(buf)
    for call in (ctx.get_buffer_meta(buf), ctx.release_buffer(buf), ctx.read_buffer(buf, 0, 1),
                 ctx.renew_buffer(buf, 5)):
        with pytest.raises(rpcbuf.NotFound):
            await call
    assert await ctx.ping() > 0


async def test_wrong_types_are_bad_requests(ctx: rpcbuf.RpcContext) -> None:
    bad_calls = [
        ctx.request_buffer("1GiB"),  # type: ignore[arg-type]
        ctx.request_buffer(0),
        ctx.request_buffer(-5),
        ctx.request_buffer(100, ttl=-1),
        ctx.request_buffer(100, timeout=float("inf")),
        ctx.store_tensor({"not": "an array"}, np.zeros(1)),  # type: ignore[arg-type]
        ctx.store_tensor("b-x", {"not": "an array"}),
        ctx.store_tensor("b-x", np.zeros(4), offset=-1),
        ctx.store_tensor("b-x", np.zeros(4), offset=1.5),  # type: ignore[arg-type]
        ctx.store_tensor("b-x", np.zeros(4), verify="md5"),
        ctx.read_buffer("b-x", 0, -1),
        ctx.read_buffer("b-x", 0, 4, out=np.zeros(2, np.uint8)),
        ctx.read_buffer("b-x", 0, 4, out=np.zeros(8, np.uint8)[::2]),
        ctx.get_buffer_meta(12),  # type: ignore[arg-type]
    ]
    for call in bad_calls:
        with pytest.raises(rpcbuf.BadRequest):
            await call
    with pytest.raises(rpcbuf.UnsupportedDevice):
        await ctx.request_buffer(100, device_type="GPU", device=3)
    with pytest.raises(rpcbuf.OutOfMemory) as info:
        await ctx.request_buffer(1 << 40)
    assert info.value.details["requested"] == 1 << 40
    assert await ctx.ping() > 0


async def test_duplicate_name(ctx: rpcbuf.RpcContext) -> None:
    buf = await ctx.request_buffer(100, name="weights/dup")
    with pytest.raises(rpcbuf.BadRequest, match="already exists"):
        await ctx.request_buffer(100, name="weights/dup")
    await ctx.release_buffer(buf)


async def test_auth_failures(clean_pool) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(rpcbuf.AuthFailed):
        await rpcbuf.connect(clean_pool.addr, token="rpcbuf1.AAAA.BBBB")
    with pytest.raises(rpcbuf.AuthFailed):
        await rpcbuf.connect(clean_pool.addr, token="")
    expired = clean_pool.token("alice", ttl=-1)
    with pytest.raises(rpcbuf.TokenExpired):
        await rpcbuf.connect(clean_pool.addr, token=expired)
    with pytest.raises(rpcbuf.ConnectionLost):
        await rpcbuf.connect("127.0.0.1:1", token="x")
    with pytest.raises(rpcbuf.BadRequest):
        await rpcbuf.connect("127.0.0.1:notaport", token="x")


async def test_tenants_are_isolated(clean_pool) -> None:  # type: ignore[no-untyped-def]
    async with clean_pool.connect("alice") as alice, clean_pool.connect("bob") as bob:
        buf = await alice.request_buffer(4096, name="secret-weights")
        await alice.store_tensor(buf, np.full(4096, 42, np.uint8))
        for call in (bob.get_buffer_meta(buf), bob.read_buffer(buf, 0, 10),
                     bob.store_tensor(buf, np.zeros(10, np.uint8)), bob.release_buffer(buf),
                     bob.renew_buffer(buf, 10)):
            with pytest.raises(rpcbuf.NotFound) as info:
                await call
            assert "bob" not in str(info.value) and "alice" not in str(info.value)
        assert buf not in {b["buffer_id"] for b in await bob.list_buffers()}
        # bob may use the same name: names are per tenant
        bbuf = await bob.request_buffer(10, name="secret-weights")
        assert (await alice.read_buffer(buf) == 42).all()
        await bob.release_buffer(bbuf)
        await alice.release_buffer(buf)


def _raw_hello(addr: str, token: str) -> socket.socket:
    raw = Raw(addr)
    assert raw.call("hello", token=token)["ok"]  # challenge, then hello with our proof
    return raw.sock


def _read_frames(s: socket.socket) -> list[dict[str, object]]:
    dec, out = P.FrameDecoder(), []
    while True:
        try:
            data = s.recv(65536)
        except (TimeoutError, ConnectionResetError):
            break
        if not data:
            break
        out += dec.feed(data)
    return out


@pytest.mark.parametrize("payload", [
    b"\x00\x00\x00\x05\xc1\xc1\xc1\xc1\xc1",                       # not msgpack
    struct.pack("!I", 1 << 30) + b"x" * 100,                        # oversized frame
    struct.pack("!I", 3) + msgpack.packb([1, 2]),                    # not a map
])
async def test_garbage_closes_only_that_connection(ctx: rpcbuf.RpcContext, clean_pool,  # type: ignore[no-untyped-def]
                                                   payload: bytes) -> None:
    s = await asyncio.to_thread(_raw_hello, clean_pool.addr, clean_pool.token("alice"))
    s.sendall(payload)
    frames = await asyncio.to_thread(_read_frames, s)  # the daemon closes the socket
    s.close()
    assert frames[-1]["ok"] is False and frames[-1]["error"]["code"] == "BAD_REQUEST"
    assert await ctx.ping() > 0  # everyone else keeps working


async def test_truncated_frame_and_silent_peer(ctx: rpcbuf.RpcContext, clean_pool) -> None:  # type: ignore[no-untyped-def]
    s = await asyncio.to_thread(_raw_hello, clean_pool.addr, clean_pool.token("alice"))
    s.sendall(struct.pack("!I", 100) + b"\x81")  # a frame that never completes
    s.shutdown(socket.SHUT_WR)
    frames = await asyncio.to_thread(_read_frames, s)
    s.close()
    assert all(f["ok"] is False for f in frames)  # no answer to half a frame
    assert await ctx.ping() > 0


async def test_bad_requests_keep_the_connection(clean_pool) -> None:  # type: ignore[no-untyped-def]
    def talk() -> list[dict[str, object]]:
        raw = Raw(clean_pool.addr)
        got = [raw.call_raw("ping")]  # before hello: id 1
        hello = raw.call("hello", token=clean_pool.token("alice"))
        assert hello["ok"]
        got.append({**hello, "id": 2})
        s = raw.sock
        s.sendall(P.encode_frame({"op": "explode", "id": 3}))
        s.sendall(P.encode_frame({"op": "store", "id": 4, "buffer_id": 1}))
        s.sendall(P.encode_frame({"op": "ping", "id": "x"}))
        s.sendall(P.encode_frame({"op": "hello", "id": 5, "token": "again"}))
        s.sendall(P.encode_frame({"op": "ping", "id": 6}))
        dec = P.FrameDecoder()
        while len(got) < 7:
            got += dec.feed(s.recv(65536))
        s.close()
        return got

    frames = {f["id"]: f for f in await asyncio.to_thread(talk)}
    assert frames[1]["error"]["code"] == "AUTH_FAILED"  # type: ignore[index]
    assert frames[2]["ok"] is True
    assert frames[3]["error"]["code"] == "BAD_REQUEST"  # type: ignore[index]
    assert frames[4]["error"]["code"] == "BAD_REQUEST"  # type: ignore[index]
    assert frames[None]["error"]["code"] == "BAD_REQUEST"  # type: ignore[index]
    assert frames[5]["error"]["code"] == "BAD_REQUEST"  # type: ignore[index]
    assert frames[6]["ok"] is True


async def test_quotas(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--device", "cpu:64MiB", "--quota", "carol:1MiB:3",
                       "--default-quota", "*:8MiB:-")
    # dave on the network path: a same-host session's staging area would take
    # 6 MiB of his 8 (carol's 1 MiB cannot spare it: she gets the network path)
    async with d.connect("carol") as carol, d.connect("dave", same_host=False) as dave:
        assert not carol.same_host
        a = await carol.request_buffer(512 << 10)
        with pytest.raises(rpcbuf.QuotaExceeded) as info:
            await carol.request_buffer(600 << 10)  # rounds to 1 MiB: over 1 MiB in total
        assert info.value.details["quota"] == 1 << 20
        b = await carol.request_buffer(1000)
        c = await carol.request_buffer(1000)
        with pytest.raises(rpcbuf.QuotaExceeded, match="buffers"):
            await carol.request_buffer(1000)
        with pytest.raises(rpcbuf.QuotaExceeded):
            await dave.request_buffer(9 << 20)
        for buf in (a, b, c):
            await carol.release_buffer(buf)
        await carol.release_buffer(await carol.request_buffer(1 << 20))  # quota came back
        await dave.release_buffer(await dave.request_buffer(8 << 20))


async def test_every_verb_of_a_closed_context_is_connection_lost(clean_pool) -> None:  # type: ignore[no-untyped-def]
    """Every verb checks its context first, whichever part does the work
    (bufferops, rangeops, blockops, tensorops, dedup, attach): after
    ``close`` each is CONNECTION_LOST, and nothing is sent."""
    c = await clean_pool.connect("alice")
    buf = await c.request_buffer(4096)  # session-scoped: released by the close
    await c.close()
    a = np.zeros(8, np.uint8)
    verbs: list[Any] = [
        lambda: c.request_buffer(64), lambda: c.clone_buffer(buf),
        lambda: c.get_buffer_meta(buf), lambda: c.open_buffer("x"),
        lambda: c.release_buffer(buf), lambda: c.renew_buffer(buf),
        lambda: c.clear_buffer(buf), lambda: c.copy_buffer(buf, 0, buf, 8, 8),
        lambda: c.list_devices(), lambda: c.list_buffers(), lambda: c.stats(),
        lambda: c.ping(), lambda: c.store_tensor(buf, a), lambda: c.read_buffer(buf, 0, 8),
        lambda: c.store_batch(buf, [(0, a)]), lambda: c.read_batch(buf, [(0, 8)]),
        lambda: c.verify_write(buf, 0, a), lambda: c.put_blocks({"k": a}),
        lambda: c.put_block("k", a), lambda: c.get_blocks(["k"], [a]),
        lambda: c.get_block("k"), lambda: c.lookup_blocks(["k"]),
        lambda: c.blocks_exist(["k"]), lambda: c.remove_blocks(["k"]),
        lambda: c.list_blocks(), lambda: c.store_tensors(buf, {"a": a}),
        lambda: c.load_tensors(buf), lambda: c.store_tensors_dedup(buf, {"a": a}),
        lambda: c.load_file(buf, "f.safetensors", 8, []), lambda: c.attach(buf),
        lambda: c.attach_block("k")]
    for verb in verbs:
        with pytest.raises(rpcbuf.ConnectionLost, match="closed"):
            await verb()

"""Connections that never authenticate: a peer that trickles bytes, announces
a huge frame, or opens many connections (control or UCX) and says nothing
cannot keep a tenant out.  Hello has one absolute deadline from accept; until
hello succeeds frames are small; unauthenticated connections have their own
cap (and one per source address) and do not count toward --max-sessions; at
a cap the oldest of them makes room for the newcomer."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time

import numpy as np
import pytest
from rawwire import Raw

import rpcbuf
from conftest import DaemonProc
from rpcbuf.control.daemon.sessions.session import END_GRACE
from rpcbuf.control.wire import protocol as P
from rpcbuf.dataplane import ucx


def _connect(addr: str, source: str = "127.0.0.1", rcvbuf: int | None = None
             ) -> socket.socket:
    host, port = addr.rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:  # before connect: it sets the window the peer sees
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.bind((source, 0))
    sock.settimeout(10)
    sock.connect((host, int(port)))
    return sock


def _closed(sock: socket.socket) -> bool:
    """Whether the daemon has closed ``sock`` (EOF or reset), without waiting."""
    sock.setblocking(False)
    try:
        while True:
            data = sock.recv(1 << 16)
            if not data:
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        sock.setblocking(True)


def _tenant(d: DaemonProc, tenant: str) -> rpcbuf.Connector:
    return rpcbuf.connect(d.addr, token=d.token(tenant), timeout=5, same_host=False)


async def _stats(d: DaemonProc) -> dict[str, object]:
    async with d.connect("probe", same_host=False) as c:
        return await c.stats()


async def test_trickling_connections_neither_count_nor_last(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """Seen: four sockets sending a byte every few seconds kept a
    --max-sessions 4 daemon refusing every tenant, for ever."""
    d = daemon_factory("--device", "cpu:4MiB", "--max-sessions", "2", "--hello-timeout", "2s")
    tricklers = [_connect(d.addr) for _ in range(4)]
    frame = struct.pack("!I", 100) + b"\x80" * 100  # never completes in time
    started = time.monotonic()
    sent = 0

    async def trickle(until: float) -> None:
        nonlocal sent
        while time.monotonic() < until:
            for s in tricklers:
                with contextlib.suppress(OSError):
                    s.send(frame[sent:sent + 1])
            sent += 1
            await asyncio.sleep(0.25)

    await trickle(started + 0.6)
    async with _tenant(d, "alice") as a, _tenant(d, "bob") as b:
        assert await a.ping() and await b.ping()  # --max-sessions counts tenants only
    await trickle(started + 4.0)  # past the hello deadline, trickling all the while
    assert all(_closed(s) for s in tricklers), "a trickling connection outlived its deadline"
    for s in tricklers:
        s.close()
    assert "no hello within" in d.log()


def test_a_big_frame_before_hello_is_refused_at_once(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """Before hello the frame limit is a few KiB: the daemon neither buffers
    --max-frame bytes for a stranger nor waits for them."""
    d = daemon_factory("--device", "cpu:4MiB", "--hello-timeout", "20s")
    raw = Raw(d.addr, timeout=3)
    raw.send(struct.pack("!I", 8 << 20) + b"\x00" * 1024)  # announces 8 MiB
    msg = raw.recv()  # (a timeout here: the daemon waited for the 8 MiB)
    assert msg is not None and msg["id"] is None, msg
    assert msg["error"]["code"] == "BAD_REQUEST" and "before hello" in msg["error"]["message"]
    assert raw.drain_to_eof(3)
    raw.close()
    raw = Raw(d.addr, timeout=3)  # a hello of ordinary size still works, then big frames
    assert raw.call("hello", token=d.token())["ok"]
    big = raw.call("ping", pad="x" * 100_000)  # past the pre-hello limit: parsed, refused
    assert big["error"]["code"] == "BAD_REQUEST" and "pad" in big["error"]["message"]
    assert raw.call("ping")["ok"]
    raw.close()


def _fill_without_reading(addr: str, seconds: float) -> socket.socket:
    """Pipeline pings before hello and read none of the answers, until the
    daemon stops taking them (its answers fill both sockets' buffers)."""
    sock = _connect(addr, rcvbuf=4096)
    sock.setblocking(False)
    burst = P.encode_frame({"id": 1, "op": "ping"}) * 512
    stop, taken = time.monotonic() + seconds, time.monotonic()
    while time.monotonic() < stop and time.monotonic() - taken < 0.3:  # full: 0.3 s refused
        try:
            sock.send(burst)
            taken = time.monotonic()
        except BlockingIOError:
            time.sleep(0.01)
        except OSError:
            break
    return sock


async def test_a_peer_that_never_reads_cannot_keep_its_connection(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """Seen: asyncio's close waits until what we wrote drains, so a stranger
    that pipelined requests and read no answer kept its fd and megabytes of
    our buffers for good after its hello deadline, and once evicted it no
    longer even counted: a loop of them ran the daemon out of fds.  A close
    now resets the connection after END_GRACE."""
    d = daemon_factory("--device", "cpu:4MiB", "--hello-timeout", "3s")
    base = d.fds()
    socks = [_fill_without_reading(d.addr, 1.0) for _ in range(2)]
    assert d.fds() >= base + 2  # (a test that cannot fail is a defect)
    for _ in range(int((3 + END_GRACE + 5) / 0.2)):  # the hello deadline, the grace, slack
        if d.fds() <= base:
            break
        await asyncio.sleep(0.2)
    assert d.fds() <= base
    assert all(_closed(s) for s in socks)
    for s in socks:
        s.close()


async def test_unauthenticated_connections_have_their_own_cap(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """Idle connections from one address beyond its cap, and from many beyond
    the global one: the oldest go, a tenant always gets in."""
    d = daemon_factory("--device", "cpu:4MiB", "--hello-timeout", "60s",
                       "--max-unauthenticated", "6", "--max-unauthenticated-per-source", "3")
    same = [_connect(d.addr) for _ in range(5)]
    await asyncio.sleep(0.3)
    assert [_closed(s) for s in same] == [True, True, False, False, False]  # oldest two went
    others = [_connect(d.addr, f"127.0.0.{2 + i % 3}") for i in range(6)]
    await asyncio.sleep(0.3)
    alive = [s for s in same + others if not _closed(s)]
    assert len(alive) <= 6
    assert not _closed(others[-1])  # the newest stays
    async with _tenant(d, "alice") as a:
        assert await a.ping()
        assert (await a.stats())["unauthenticated"] <= 6
    for s in same + others:
        s.close()


async def test_ucx_endpoints_that_never_bind_are_capped(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--device", "cpu:4MiB", "--hello-timeout", "60s",
                       "--max-unauthenticated", "4")
    host = d.addr.rsplit(":", 1)[0]
    eps = [await ucx.connect(host, d.ucx_port) for _ in range(7)]
    try:
        # The oldest endpoints are dropped by the daemon: a receive on them fails.
        with pytest.raises(ucx.TransferError):
            await asyncio.wait_for(eps[0].recv(np.zeros(1, np.uint8), ucx.BIND_TAG), 10)
        st = await _stats(d)  # (a tenant binds its own endpoint meanwhile)
        assert st["pending_endpoints"] <= 4
        async with _tenant(d, "alice") as a:
            bid = await a.request_buffer(4096)
            await a.store_tensor(bid, np.ones(4096, np.uint8))
            await a.release_buffer(bid)
    finally:
        for ep in eps:
            ep.abort()



async def test_control_listener_has_a_deep_backlog(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """asyncio's default backlog (100) let one process flooding connects push
    legitimate connects into SYN retries (~2 s each, 1 in 6 timed out).  The
    kernel shows a listener's backlog as its Send-Q (``ss -ltn``)."""
    import shutil
    import subprocess

    if shutil.which("ss") is None:
        pytest.skip("no ss (iproute2) here to read the listen backlog")
    d = daemon_factory("--device", "cpu:1MiB")
    port = d.addr.rsplit(":", 1)[1]
    out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True,
                         timeout=10, check=True).stdout.split()
    assert int(out[2]) >= 1024, out

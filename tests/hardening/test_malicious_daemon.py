"""A malicious or broken daemon must not hang a client: what it says in hello
is checked before it is trusted (a bad field is BAD_REQUEST naming it), and
every wait of a call (an in-flight slot, the answer, connection setup, the
data endpoint's bind) is bounded by the call's timeout or ends at once when
the control connection is lost.  The daemon is ``fakedaemon.FakeDaemon``:
the real framing, hostile answers."""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from fakedaemon import TOKEN, Conn, FakeDaemon, hello_answer, send_handle, staging_fd

import rpcbuf
from rpcbuf.control.wire.errors import BadRequest, ConnectionLost, Forbidden, RpcBufError, Timeout
from rpcbuf.dataplane import staging

LIMITS = {"max_frame": 16 << 20, "max_inflight": 4, "transfer_timeout": 30.0}


async def opened(answer: dict[str, Any] | None, silent_ops: tuple[str, ...] = (),
                 unix: bool = False) -> AsyncIterator[str]:
    """A fake daemon's address: TCP, or ``unix:PATH`` (its peer is this
    process, which the client's peer check trusts)."""
    async def handler(conn: Conn, req: dict[str, Any]) -> None:
        if req["op"] == "hello":
            if answer is not None:
                conn.answer(req, answer)
        elif req["op"] == "bind_handles":  # as a real daemon: the staging area
            fd = staging_fd()
            send_handle(conn, 0, staging.SIZE, fd)
            os.close(fd)
        elif req["op"] not in silent_ops:
            conn.answer(req, {})

    fd = FakeDaemon(handler)
    if not unix:
        try:
            yield await fd.start()
        finally:
            await fd.close()
        return
    async for addr in on_unix_socket(fd):
        yield addr


async def on_unix_socket(fd: FakeDaemon) -> AsyncIterator[str]:
    """``fd`` served on a Unix socket of its own: ``unix:PATH``, removed after."""
    path = os.path.join(tempfile.mkdtemp(prefix="fake-rpcbufd-"), "sock")
    server = await asyncio.start_unix_server(fd._serve, path)
    try:
        yield f"unix:{path}"
    finally:
        await fd.close()
        server.close()
        await server.wait_closed()
        os.unlink(path)
        os.rmdir(os.path.dirname(path))


@pytest.fixture
async def never_answers() -> AsyncIterator[str]:
    async for addr in opened(None):
        yield addr


async def connect_to(answer: dict[str, Any], **kw: Any) -> rpcbuf.RpcContext:
    gen = opened(answer, kw.pop("silent_ops", ()), unix=True)
    addr = await gen.__anext__()
    try:
        return await rpcbuf.connect(addr, token=TOKEN, same_host=True, **kw)
    finally:
        await gen.aclose()


def local(**over: Any) -> dict[str, Any]:
    """A hello answer on the same-host path (no UCX endpoint to bind), as
    the daemon gives on its Unix socket."""
    return hello_answer(**{"same_host": True, "handles_nonce": os.urandom(16), **over})


async def test_hello_never_answered_times_out(never_answers: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(Timeout):
        await rpcbuf.connect(never_answers, token=TOKEN, timeout=1, same_host=False)
    assert time.monotonic() - t0 < 3


@pytest.mark.parametrize("field,limits", [
    ("max_inflight", {**LIMITS, "max_inflight": 0}),
    ("max_inflight", {**LIMITS, "max_inflight": -3}),
    ("max_inflight", {**LIMITS, "max_inflight": 1 << 40}),
    ("max_inflight", {**LIMITS, "max_inflight": "64"}),
    ("max_inflight", {**LIMITS, "max_inflight": True}),
    ("max_frame", {**LIMITS, "max_frame": 1 << 50}),
    ("max_frame", {**LIMITS, "max_frame": 10}),
    ("transfer_timeout", {**LIMITS, "transfer_timeout": float("inf")}),
    ("transfer_timeout", {**LIMITS, "transfer_timeout": float("nan")}),
    ("transfer_timeout", {**LIMITS, "transfer_timeout": -1.0}),
    ("transfer_timeout", {**LIMITS, "transfer_timeout": 1e30}),
    ("transfer_timeout", {k: v for k, v in LIMITS.items() if k != "transfer_timeout"}),
    ("limits", [1, 2]),
])
async def test_bad_limits_are_refused(field: str, limits: Any) -> None:
    with pytest.raises(BadRequest) as info:
        await connect_to(local(limits=limits), timeout=2)
    assert info.value.details.get("field", "").endswith(field), info.value


@pytest.mark.parametrize("over", [
    {"session_id": 7}, {"session_id": "s" * 100_000}, {"session_id": ...},
    {"tenant": None}, {"node_id": b"raw"}, {"tenant": ""},
    {"bind_nonce": b"short"}, {"bind_nonce": "x" * 16},
    {"ucx": {"port": 0}}, {"ucx": {"port": 70000}}, {"ucx": {"port": "7701"}}, {"ucx": 5},
    {"version": 99}, {"same_host": "yes"}, {"same_host": 1}, {"same_host_why": ["no"]},
    {"handles_nonce": b"short"}, {"handles_nonce": ...},
    {"devices": "cpu"}, {"devices": [{}] * 100_000}, {"devices": [{"key": "cpu:0"}]},
    {"checksum_kinds": {"cpu:0": "md5"}}, {"checksum_kinds": ["xxh3"]},
    {"local": {"socket": "@x", "boot_id": "b", "pid": -1}},
    {"local": {"socket": "a\0b", "boot_id": "b", "pid": 1}},
    {"local": {"socket": "/" + "x" * 200, "boot_id": "b", "pid": 1}},
    {"local": "unix:@x"},
])
async def test_bad_hello_fields_are_refused(over: dict[str, Any]) -> None:
    field = next(iter(over))
    with pytest.raises(BadRequest) as info:
        await connect_to(local(**over), timeout=2)
    assert info.value.details.get("field", "").startswith(field), info.value


async def test_slot_wait_counts_against_the_timeout() -> None:
    """max_inflight 1 and a daemon that never answers ping: the second call
    waits for a slot, and that wait is part of its own timeout."""
    async for addr in opened(local(limits={**LIMITS, "max_inflight": 1}), ("ping",), True):
        ctx = await rpcbuf.connect(addr, token=TOKEN, timeout=5)
        try:
            first = asyncio.ensure_future(ctx.ping(timeout=30))
            await asyncio.sleep(0.05)
            t0 = time.monotonic()
            with pytest.raises(Timeout):
                await ctx.ping(timeout=0.5)
            assert time.monotonic() - t0 < 2
            with pytest.raises(Timeout, match="slot"):
                await ctx.stats(timeout=0.3)
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
            assert await ctx.stats(timeout=2) == {}  # the slot came back
        finally:
            await ctx.close()


async def test_ping_timeout_when_daemon_is_silent() -> None:
    async for addr in opened(local(), ("ping",), True):
        ctx = await rpcbuf.connect(addr, token=TOKEN, timeout=5)
        try:
            t0 = time.monotonic()
            with pytest.raises(Timeout):
                await ctx.ping(timeout=0.5)
            assert time.monotonic() - t0 < 2
            assert await ctx.stats(timeout=2) == {}  # the connection stays usable
        finally:
            await ctx.close()


async def test_connect_is_bounded_as_a_whole() -> None:
    """A daemon that answers hello but whose UCX port leads nowhere useful
    (a listener that takes the nonce and never acknowledges it): connect
    raises within its timeout, not the sum of its steps' timeouts."""
    async def handler(conn: Conn, req: dict[str, Any]) -> None:
        conn.answer(req, hello_answer(ucx={"port": fd.ucx_port}))

    fd = FakeDaemon(handler, ucx_listener=True, bind=False)
    addr = await fd.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(Timeout):
            await rpcbuf.connect(addr, token=TOKEN, timeout=1.5, same_host=False)
        assert time.monotonic() - t0 < 3
    finally:
        await fd.close()


async def test_lost_control_connection_ends_the_bind_at_once() -> None:
    """The daemon goes away (EOF) while the data endpoint waits for its bind
    acknowledgement: connect fails with CONNECTION_LOST then, not at its timeout."""
    async def handler(conn: Conn, req: dict[str, Any]) -> None:
        conn.answer(req, hello_answer(ucx={"port": fd.ucx_port}))
        asyncio.get_running_loop().call_later(0.3, conn.close)

    fd = FakeDaemon(handler, ucx_listener=True, bind=False)
    addr = await fd.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(ConnectionLost):
            await rpcbuf.connect(addr, token=TOKEN, timeout=20, same_host=False)
        assert time.monotonic() - t0 < 5
    finally:
        await fd.close()


# -- the Unix socket's peer is checked before the token goes out ------------------


async def unix_daemon(path: str, seen: list[dict[str, Any]]) -> asyncio.Server:
    async def handler(conn: Conn, req: dict[str, Any]) -> None:
        seen.append(req)
        conn.answer(req, local())

    fd = FakeDaemon(handler)
    return await asyncio.start_unix_server(fd._serve, path)


async def test_path_socket_owned_by_a_stranger_gets_no_token(tmp_path: Any) -> None:
    """The process listening on the socket is not one we trust: not root,
    not us, not the socket file's owner.  Tests run as root, and root is
    trusted, so the test plays the other side through the check's
    ``trusted`` argument (the uids trusted besides the file's owner)."""
    from rpcbuf.control.client.context import check_unix_peer

    path = str(tmp_path / "rpcbufd.sock")
    seen: list[dict[str, Any]] = []
    server = await unix_daemon(path, seen)
    try:
        os.chown(path, 4242, 4242)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        try:
            with pytest.raises(Forbidden) as info:
                check_unix_peer(sock, path, None, trusted=frozenset({1234}))
            assert "uid 0" in str(info.value)
            check_unix_peer(sock, path, None, trusted=frozenset({0}))  # root: fine
            with pytest.raises(Forbidden, match="pid"):  # not the pid the daemon named
                check_unix_peer(sock, path, os.getpid() + 1, trusted=frozenset({0}))
        finally:
            sock.close()
    finally:
        server.close()
        await server.wait_closed()
    assert not seen


async def test_connect_checks_the_peer_before_the_token(tmp_path: Any) -> None:
    """The daemon's TCP hello names a Unix socket and a pid; the process on
    that socket is another one (a squatter): the client stays on TCP and the
    squatter never sees the token."""
    path = str(tmp_path / "squat.sock")
    seen: list[dict[str, Any]] = []
    squatter = await unix_daemon(path, seen)
    from rpcbuf.dataplane import shm

    other_pid = 1 if os.getpid() != 1 else 2
    tcp_answer = hello_answer(local={"socket": path, "boot_id": shm.boot_id(),
                                     "pid": other_pid}, same_host=True)
    gen = opened(tcp_answer)
    addr = await gen.__anext__()
    try:
        with pytest.raises(RpcBufError):  # same_host=True: why it was refused
            await rpcbuf.connect(addr, token="secret-token", timeout=3, same_host=True)
    finally:
        await gen.aclose()
        squatter.close()
        await squatter.wait_closed()
    assert not seen, "the token went to a process that is not the daemon"


async def test_tcp_hello_cannot_claim_the_same_host_path() -> None:
    """Only the daemon's Unix socket can offer the same-host path (the kernel
    names the client to it there); a TCP hello claiming it is refused."""
    gen = opened(hello_answer(same_host=True))
    addr = await gen.__anext__()
    try:
        with pytest.raises(BadRequest) as info:
            await rpcbuf.connect(addr, token=TOKEN, timeout=2, same_host=False)
        assert info.value.details.get("field") == "same_host"
    finally:
        await gen.aclose()


# -- the handle channel: what the daemon sends by handle is checked --------------------


async def _handle_daemon(on_bind: Any, on_attach: Any = None) -> AsyncIterator[str]:
    """A fake Unix-socket daemon granting the same-host path, whose handle
    channel (and attach answers) do what the test says."""
    bound: list[Conn] = []

    async def handler(conn: Conn, req: dict[str, Any]) -> None:
        if req["op"] == "hello":  # (a real UCX listener: the client falls back to it)
            conn.answer(req, local(ucx={"port": fd.ucx_port}))
        elif req["op"] == "bind_handles":
            bound.append(conn)
            on_bind(conn)
        elif req["op"] == "attach" and on_attach is not None:
            on_attach(bound[0], conn, req)
        else:
            conn.answer(req, {})

    fd = FakeDaemon(handler, ucx_listener=True)
    await fd.start()
    async for addr in on_unix_socket(fd):
        yield addr


def _send_staging(size: int = staging.SIZE, seal: bool = True, record_size: int | None = None,
                  fd_too: bool = True) -> Any:
    def on_bind(conn: Conn) -> None:
        fd = staging_fd(size, seal)
        send_handle(conn, 0, record_size or size, fd if fd_too else None)
        os.close(fd)
    return on_bind


@pytest.mark.parametrize("on_bind, why", [
    (_send_staging(seal=False), "can shrink"),
    (_send_staging(size=4096), "not"),
    (_send_staging(record_size=1 << 40), "not"),
    (_send_staging(fd_too=False), "exactly one fd"),
    (lambda conn: conn.answer({"id": 1}, {}), "fd"),  # msgpack where records belong
    (lambda conn: conn.close(), "closed"),
])
async def test_a_bad_staging_area_turns_the_same_host_path_off(on_bind: Any, why: str) -> None:
    """A staging area that could shrink under our mapping (SIGBUS here), of
    the wrong size, without its fd, or no record at all: the session goes on
    without the same-host path, and says why; required, it is refused."""
    async for addr in _handle_daemon(on_bind):
        async with rpcbuf.connect(addr, token=TOKEN, timeout=5) as c:
            assert not c.same_host
            assert why in c.hello["same_host_why"], c.hello["same_host_why"]
        with pytest.raises(BadRequest, match="same-host path is not available"):
            await rpcbuf.connect(addr, token=TOKEN, timeout=5, same_host=True)


def _attach_with(fd_of: Any, meta: dict[str, Any]) -> Any:
    def on_attach(channel: Conn, conn: Conn, req: dict[str, Any]) -> None:
        fd, nbytes = fd_of()
        send_handle(channel, req["id"], nbytes, fd)
        os.close(fd)
        conn.answer(req, meta)
    return on_attach


def _writable(size: int = 8192) -> tuple[int, int]:
    from rpcbuf.dataplane import shm
    return shm.memfd(size, "fake-buffer"), size


def _read_only(size: int = 8192, seal: bool = True) -> tuple[int, int]:
    from rpcbuf.dataplane import shm
    fd = shm.memfd(size, "fake-buffer")
    if seal:
        shm.seal_read_only(fd)
    ro = shm.read_only_fd(fd)
    os.close(fd)
    return ro, size


META = {"buffer_id": "b-x", "size": 8192, "alloc_size": 8192, "tensors": {}}


@pytest.mark.parametrize("fd_of, meta, why", [
    (_writable, META, "read-only"),  # a handle we could write through: refused
    (lambda: _read_only(seal=False), META, "sealed"),  # someone else could
    (lambda: (_read_only(4096)[0], 8192), META, "4096 bytes"),  # not the size it claims
    (_read_only, {**META, "alloc_size": 1 << 40}, "does not match"),
    (_read_only, {**META, "size": 9000}, "does not match"),
])
async def test_an_attach_handle_must_be_read_only_sealed_and_sized(
        fd_of: Any, meta: dict[str, Any], why: str) -> None:
    async for addr in _handle_daemon(_send_staging(), _attach_with(fd_of, meta)):
        async with rpcbuf.connect(addr, token=TOKEN, timeout=5) as c:
            assert c.same_host
            with pytest.raises(ConnectionLost, match=why):
                await c.attach("b-x")


async def test_a_manifest_entry_outside_the_buffer_is_refused() -> None:
    bad = {**META, "tensors": {"w": {"dtype": "float32", "shape": [4096], "offset": 0,
                                     "nbytes": 16384}}}
    async for addr in _handle_daemon(_send_staging(), _attach_with(_read_only, bad)):
        async with rpcbuf.connect(addr, token=TOKEN, timeout=5) as c:
            async with c.attach("b-x") as view:
                with pytest.raises(ConnectionLost, match="outside"):
                    view.tensors()
                assert view.array().nbytes == 8192


@pytest.mark.parametrize("data", [b"x" * 4095, b"x" * 4097, "x" * 4096, None, 7])
async def test_an_inline_read_answer_must_carry_exactly_the_bytes_asked(data: Any) -> None:
    """A read whose bytes ride in its answer (path "inline"): fewer, more,
    or no bytes is CONNECTION_LOST, and nothing was written into ``out``."""
    async def handler(conn: Conn, req: dict[str, Any]) -> None:
        if req["op"] == "hello":
            conn.answer(req, hello_answer(ucx={"port": fd.ucx_port}, inline_max=65536))
        elif req["op"] == "get_buffer_meta":
            conn.answer(req, {**META, "device_type": "CPU", "device": 0})
        elif req["op"] == "read":
            assert req.get("path") == "inline", req  # small: it asks for the bytes inline
            conn.answer(req, {"nbytes": req["nbytes"], **({} if data is None else
                                                          {"data": data})})
        else:
            conn.answer(req, {})

    fd = FakeDaemon(handler, ucx_listener=True)
    addr = await fd.start()
    try:
        async with rpcbuf.connect(addr, token=TOKEN, timeout=5, same_host=False) as c:
            out = np.zeros(4096, np.uint8)
            with pytest.raises(ConnectionLost, match="4096 bytes"):
                await c.read_buffer("b-x", 0, 4096, out=out)
            assert not out.any()
    finally:
        await fd.close()


async def test_an_inline_max_out_of_range_is_refused() -> None:
    for bad in (-1, 1 << 40, "64k", True):
        with pytest.raises(BadRequest, match="inline_max"):
            await connect_to(local(inline_max=bad), timeout=2)

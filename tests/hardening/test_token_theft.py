"""A token is never stolen on loopback TCP (issue 34, H3).

Protocol 3 sent the bearer token in hello to whoever held 127.0.0.1:PORT:
while the daemon restarted, a process running as ``nobody`` bound the port,
received alice's token, and read her block from the real daemon.  Now the
token never crosses the wire (``wire/auth.py``): the client names its
claims, checks the daemon's proof over a fresh nonce before it goes on, and
proves it holds the token's signature over both nonces.  Here an impostor
(``fakedaemon.FakeDaemon`` with no key: a plain asyncio server speaking the
wire protocol) gets no byte of the signature and is refused by the client,
what it did get opens nothing at the real daemon, a captured session's bytes
replayed to the real daemon open nothing, and wrong, forged and expired
tokens still get AUTH_FAILED and TOKEN_EXPIRED.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
from typing import Any

import pytest
from fakedaemon import TOKEN, Conn, FakeDaemon, hello_answer
from rawwire import Raw

import rpcbuf
from rpcbuf.control.formats import keyfile
from rpcbuf.control.wire import auth, protocol as P


def _signature(token: str) -> tuple[bytes, bytes]:
    """The token's secret part, as text and as the 32 bytes it spells."""
    text = token.rpartition(".")[2]
    return text.encode(), base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _replay(addr: str, data: bytes) -> list[dict[str, Any]]:
    """Send ``data``'s frames, as captured, to the daemon at ``addr``; then a
    ping: the answers, in order."""
    frames = P.FrameDecoder().feed(data)
    raw = Raw(addr)
    try:
        answers = []
        for f in frames:
            raw.send(P.encode_frame(f))
            msg = raw.recv()
            assert msg is not None
            answers.append(msg)
        raw._next_id = 1000
        answers.append(raw.call_raw("ping"))
        return answers
    finally:
        raw.close()


async def test_an_impostor_on_loopback_gets_no_token_and_is_refused(  # type: ignore[no-untyped-def]
        daemon_factory) -> None:
    d = daemon_factory("--device", "cpu:16MiB")
    token = d.token("alice")

    async def impostor_says(conn: Conn, req: dict[str, Any]) -> None:
        if req["op"] == "hello":  # it answers as the daemon would, if it gets that far
            conn.answer(req, hello_answer(tenant="alice"))

    impostor = FakeDaemon(impostor_says, keys=None)  # holds no key: its proof is noise
    addr = await impostor.start()
    error: BaseException | None = None
    try:
        async with rpcbuf.connect(addr, token=token, timeout=5, same_host=False):
            pass
    except rpcbuf.RpcBufError as exc:
        error = exc
    finally:
        await impostor.close()
    got = bytes(impostor.received)
    text, secret = _signature(token)
    assert got, "the client said nothing"
    assert text not in got and secret not in got  # before: the whole token, in hello
    assert isinstance(error, rpcbuf.AuthFailed), error
    assert error.details["reason"] == "daemon_unproven"
    assert f"the daemon at {addr} could not prove it holds the node's key" in error.message
    assert [f["op"] for f in P.FrameDecoder().feed(got)] == ["challenge"]  # and no hello
    # What it got, replayed to the real daemon, opens no session.
    answers = await asyncio.to_thread(_replay, d.addr, got)
    assert answers[-1]["error"]["code"] == "AUTH_FAILED", answers  # the ping: no session


async def test_a_captured_session_replayed_opens_nothing(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """A recording relay in front of the real daemon (what a sniffer on the
    path sees): the session through it works (an active relay to a live
    daemon is the limit only TLS closes), but its bytes, replayed, do not."""
    d = daemon_factory("--device", "cpu:16MiB")
    token = d.token("alice")
    host, port = d.addr.rsplit(":", 1)
    captured = bytearray()
    pipes: list[asyncio.Task[None]] = []

    async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, keep: bool) -> None:
        try:
            with contextlib.suppress(ConnectionError, OSError):
                while data := await src.read(1 << 16):
                    if keep:
                        captured.extend(data)
                    dst.write(data)
        finally:
            dst.close()

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection(host, int(port))
        pipes.extend([asyncio.create_task(pipe(reader, up_w, True)),
                      asyncio.create_task(pipe(up_r, writer, False))])

    server = await asyncio.start_server(relay, "127.0.0.1", 0)
    relay_addr = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with rpcbuf.connect(relay_addr, token=token, timeout=10, same_host=False) as c:
            assert await c.ping() >= 0
    finally:
        server.close()
        for t in pipes:
            t.cancel()
        await asyncio.gather(*pipes, return_exceptions=True)  # ended here, not by the GC
        await server.wait_closed()
    got = bytes(captured)
    text, secret = _signature(token)
    assert text not in got and secret not in got
    assert [f["op"] for f in P.FrameDecoder().feed(got)][:2] == ["challenge", "hello"]
    answers = await asyncio.to_thread(_replay, d.addr, got)
    assert answers[0]["ok"]  # the challenge: a fresh nonce, so the old proof ...
    assert answers[1]["error"]["code"] == "AUTH_FAILED", answers  # ... does not match it
    assert "proof does not match" in answers[1]["error"]["message"]
    assert all(a["error"]["code"] == "AUTH_FAILED" for a in answers[2:]), answers


def test_a_proof_without_the_signature_is_refused_before_the_claims(  # type: ignore[no-untyped-def]
        daemon_factory) -> None:
    """Someone with the claims (not secret: they are in every hello) but not
    the signature cannot prove; an expired token's claims with a wrong proof
    are AUTH_FAILED, not TOKEN_EXPIRED (the proof is checked first); a hello
    without its challenge, or a second one on the same challenge, opens
    nothing."""
    d = daemon_factory("--device", "cpu:16MiB")
    for token in (d.token("alice"), d.token("alice", ttl=-60)):
        claims = token.rpartition(".")[0]
        raw = Raw(d.addr)
        try:
            said = raw.call_raw("challenge", claims=claims, nonce=os.urandom(32),
                                versions=[P.PROTOCOL_VERSION, P.PROTOCOL_VERSION])
            assert said["ok"], said
            msg = raw.call_raw("hello", proof=os.urandom(32))
            assert msg["error"]["code"] == "AUTH_FAILED", msg
            assert "proof does not match" in msg["error"]["message"]
            again = raw.call("hello", token=token)  # the challenge is used up
            assert again["error"]["code"] == "BAD_REQUEST", again
        finally:
            raw.close()
    raw = Raw(d.addr)
    try:
        msg = raw.call_raw("hello", proof=os.urandom(32))
        assert msg["error"]["details"]["reason"] == "no_challenge", msg
    finally:
        raw.close()


async def test_wrong_forged_and_expired_tokens(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--device", "cpu:16MiB")
    with pytest.raises(rpcbuf.TokenExpired):
        await rpcbuf.connect(d.addr, token=d.token("alice", ttl=-60), timeout=10)
    other = auth.create_token(auth.Keyring.single(b"k" * 32), "alice", 60)  # another key
    with pytest.raises(rpcbuf.AuthFailed) as info:
        await rpcbuf.connect(d.addr, token=other, timeout=10)
    assert info.value.details["reason"] == "daemon_unproven"
    header, payload, sig = d.token("alice").split(".")
    forged = base64.urlsafe_b64encode(base64.urlsafe_b64decode(payload + "==").replace(
        b'"alice"', b'"bobby"')).rstrip(b"=").decode()
    with pytest.raises(rpcbuf.AuthFailed):  # alice's signature on bob's claims
        await rpcbuf.connect(d.addr, token=f"{header}.{forged}.{sig}", timeout=10)
    unknown = auth.create_token(auth.Keyring({"k9": b"k" * 32}), "alice", 60)
    with pytest.raises(rpcbuf.AuthFailed, match="unknown or revoked"):
        await rpcbuf.connect(d.addr, token=unknown, timeout=10)
    for bad in ("garbage", "a.b.c", "rpcbuf1.x.y"):
        with pytest.raises(rpcbuf.AuthFailed):
            await rpcbuf.connect(d.addr, token=bad, timeout=10)
    async with d.connect("alice") as c:  # the right one still works
        assert c.hello["tenant"] == "alice"


async def test_a_token_as_long_as_any_minted_says_hello(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """Its claims travel in the challenge, under the 4 KiB frame before
    hello: a token narrowed to 120 nodes (1,600 characters; a plain string
    field stopped at 1,024) still opens a session."""
    d = daemon_factory("--device", "cpu:16MiB", "--node-id", "n000")
    keys = keyfile.load_keys(d.secret_file)
    token = auth.create_token(keys, "alice", 60, nodes=[f"n{i:03d}" for i in range(120)])
    assert len(token.rpartition(".")[0]) > P.MAX_STR
    async with rpcbuf.connect(d.addr, token=token, timeout=10) as c:
        assert c.hello["tenant"] == "alice"


async def test_an_impostor_gets_only_a_small_frame_decoded() -> None:
    """Before the daemon's proof, the client decodes at most 64 KiB frames:
    an impostor answered the challenge with a 16 MiB frame of nested empty
    maps and the client built 1.2 GB.  Now the frame is refused from its
    header, nothing built, and the client says so."""
    async def bomb(conn: Conn, req: dict[str, Any]) -> None:
        if req["op"] == "challenge":
            body = b"\x81\xa2id" + bytes([req["id"]]) + b"\x80" * (15 << 20)
            conn.writer.write(len(body).to_bytes(4, "big") + body)

    impostor = FakeDaemon(bomb, keys=None, challenges=False)
    addr = await impostor.start()
    try:
        with pytest.raises(rpcbuf.RpcBufError, match="before the daemon proved"):
            async with rpcbuf.connect(addr, token=TOKEN, timeout=20, same_host=False):
                pass
    finally:
        await impostor.close()


def test_a_challenge_is_tried_once_per_connection(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """A refused challenge (a key id the node does not hold) used to leave
    the connection free to try the next: one connection could probe key ids
    until its hello deadline.  One try, whatever its outcome."""
    d = daemon_factory("--device", "cpu:16MiB")
    claims = d.token("alice").rpartition(".")[0]
    header = base64.urlsafe_b64encode(b'{"alg":"HS256","kid":"nope","typ":"JWT"}').rstrip(b"=")
    unknown = header.decode() + "." + claims.partition(".")[2]
    raw = Raw(d.addr)
    try:
        said = raw.call_raw("challenge", claims=unknown, nonce=os.urandom(32),
                            versions=[P.PROTOCOL_VERSION, P.PROTOCOL_VERSION])
        assert said["error"]["code"] == "AUTH_FAILED", said
        again = raw.call_raw("challenge", claims=claims, nonce=os.urandom(32),
                             versions=[P.PROTOCOL_VERSION, P.PROTOCOL_VERSION])
        assert again["error"]["code"] == "BAD_REQUEST", again
        assert "once per connection" in again["error"]["message"]
    finally:
        raw.close()

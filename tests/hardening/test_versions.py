"""Protocol versions: a client and a daemon of different versions agree on
the newest version both speak, or refuse with one sentence naming both
(``P.version_mismatch``), in both directions: a real daemon asked for
versions it does not speak, and a fake version-1 daemon (it knows no
``versions`` field and wants version 1 exactly, as the daemon did before
negotiation) met by this client, which says hello again the old way when it
still speaks 1 and refuses when it does not."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from fakedaemon import Conn, FakeDaemon, hello_answer
from rawwire import Raw

import rpcbuf
from control.client import batches
from control.wire import protocol as P
from control.wire.errors import BadRequest

# -- sans-I/O --------------------------------------------------------------------------


def test_negotiate_picks_the_newest_common_version() -> None:
    assert P.negotiate((1, 2), (1, 2)) == 2
    assert P.negotiate((1, 5), (1, 2)) == 2
    assert P.negotiate((2, 2), (1, 3)) == 2
    assert P.negotiate((1, 1), (1, 2)) == 1
    with pytest.raises(BadRequest) as info:
        P.negotiate((3, 4), (1, 2))
    assert info.value.message.startswith("the node speaks protocol 1..2, this client "
                                         "speaks 3..4")
    assert info.value.details == {"reason": "protocol_version", "node": [1, 2],
                                  "client": [3, 4]}


def test_hello_versions() -> None:
    assert P.hello_versions(P.Hello("t", version=1)) == (1, 1)  # a version-1 client
    assert P.hello_versions(P.Hello("t", versions=[1, 2])) == (1, 2)
    for bad in ([2, 1], [1], [0, 1], [1, 2, 3]):
        with pytest.raises(BadRequest, match="versions"):
            P.hello_versions(P.Hello("t", versions=bad))


def test_batches_state_their_checksum_kind_from_protocol_2() -> None:
    items = [(0, np.ones(8, np.uint8))]
    new, _ = batches.store_batch("b", items, "checksum", None, None, state_kind=True)
    old, _ = batches.store_batch("b", items, "checksum", None, None, state_kind=False)
    assert new.request(False).to_wire(1)["checksum_kind"] == "xxh3"
    assert "checksum_kind" not in old.request(False).to_wire(1)  # a version-1 daemon refuses it


# -- a real daemon ---------------------------------------------------------------------


def test_daemon_negotiates_or_names_both_ranges(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--device", "cpu:16MiB")
    raw = Raw(d.addr)
    try:
        msg = raw.call("hello", token=d.token(), version=9, versions=[8, 9])
        assert not msg["ok"] and msg["error"]["code"] == "BAD_REQUEST"
        assert msg["error"]["message"].startswith(
            f"the node speaks protocol {P.PROTOCOL_MIN}..{P.PROTOCOL_VERSION}, this client "
            "speaks 8..9")
        assert msg["error"]["details"]["reason"] == "protocol_version"
        old = raw.call("hello", token=d.token(), version=1)  # a version-1 client: still served
        assert old["ok"] and old["result"]["version"] == 1
    finally:
        raw.close()


async def test_client_and_daemon_speak_the_newest(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--device", "cpu:16MiB")
    async with d.connect() as c:
        assert c.protocol_version == P.PROTOCOL_VERSION
        assert c.hello["versions"] == [P.PROTOCOL_MIN, P.PROTOCOL_VERSION]
        assert c.hello["checksum_kinds"] == {"cpu:0": "xxh3"}
        buf = await c.request_buffer(4096)
        # the batch states its checksum kind: a daemon of this version takes it
        await c.store_batch(buf, [(0, np.ones(64, np.uint8))], verify="checksum")
        await c.release_buffer(buf)


# -- a version-1 daemon ------------------------------------------------------------------


@pytest.fixture
async def old_daemon() -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    """A daemon as it was before versions: unknown fields and any version
    but 1 are a bare BAD_REQUEST; the connection stays open."""
    hellos: list[dict[str, Any]] = []

    async def handler(conn: Conn, req: dict[str, Any]) -> None:
        if req["op"] != "hello":
            conn.answer(req, {})
            return
        hellos.append(req)
        fields = {k: v for k, v in req.items() if k not in ("op", "id")}
        unknown = sorted(set(fields) - {"token", "version", "probe", "probe_addr", "replaces"})
        if unknown:
            error = BadRequest(f"hello: unknown field(s) {unknown}")
        elif fields.get("version", 1) != 1:
            error = BadRequest(f"protocol version {fields['version']} is not supported",
                               {"supported": [1]})
        else:
            conn.answer(req, hello_answer(version=1, versions=..., checksum_kinds=...))
            return
        conn.send(P.error_response(req["id"], error))

    fd = FakeDaemon(handler)
    try:
        yield await fd.start(), hellos
    finally:
        await fd.close()


async def test_a_version_1_daemon_is_spoken_to_in_version_1(
        old_daemon: tuple[str, list[dict[str, Any]]]) -> None:
    addr, hellos = old_daemon
    ctx = rpcbuf.RpcContext(*await _hello_only(addr))
    assert ctx.protocol_version == 1
    assert [h.get("versions") for h in hellos] == [[P.PROTOCOL_MIN, P.PROTOCOL_VERSION], None]
    assert hellos[1]["version"] == 1
    ctx.abort()


async def test_a_client_past_version_1_refuses_naming_both(
        old_daemon: tuple[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch) -> None:
    addr, _ = old_daemon
    monkeypatch.setattr(P, "PROTOCOL_MIN", 2)
    monkeypatch.setattr(P, "PROTOCOL_VERSION", 3)
    with pytest.raises(BadRequest) as info:
        await rpcbuf.connect(addr, token="t", timeout=5, same_host=False)
    assert info.value.message.startswith("the node speaks protocol 1, this client speaks 2..3")
    assert info.value.details["reason"] == "protocol_version"


async def test_a_daemon_answering_a_version_we_do_not_speak_is_refused() -> None:
    async def handler(conn: Conn, req: dict[str, Any]) -> None:
        conn.answer(req, hello_answer(version=7))

    fd = FakeDaemon(handler)
    addr = await fd.start()
    try:
        with pytest.raises(BadRequest) as info:
            await rpcbuf.connect(addr, token="t", timeout=5, same_host=False)
        assert info.value.message.startswith(
            f"the node speaks protocol 7, this client speaks "
            f"{P.PROTOCOL_MIN}..{P.PROTOCOL_VERSION}")
        assert info.value.details["field"] == "version"
    finally:
        await fd.close()


async def _hello_only(addr: str) -> tuple[Any, ...]:
    """Open a session without binding UCX (the fake has no UCX listener):
    what ``RpcContext`` is made of."""
    from control.client.opening import open_session

    opened = await open_session(addr, "t", 5, None, False)
    return opened.conn, opened.hello, opened.raw, 5.0

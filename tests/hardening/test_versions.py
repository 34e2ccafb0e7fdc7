"""Protocol versions: a client and a daemon agree on the newest version both
speak, or refuse with one sentence naming both (``P.version_mismatch``), in
both directions.  Versions 1 to 3 were development builds, and their hello
fields are gone (issue 39, item 6): a real daemon refuses a hello of any of
them (it carried the bearer token) and opens nothing, and this client says hello once:
it never tries again "the old way" on an error's wording, and never sends
the token to a daemon that cannot prove it holds the node's key."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from fakedaemon import TOKEN, Conn, FakeDaemon, hello_answer
from rawwire import Raw

import rpcbuf
from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.errors import BadRequest

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


def test_challenge_versions() -> None:
    assert P.challenge_versions(P.Challenge("c", b"n", [4, 5])) == (4, 5)
    for bad in ([2, 1], [1], [0, 1], [1, 2, 3]):
        with pytest.raises(BadRequest, match="versions"):
            P.challenge_versions(P.Challenge("c", b"n", bad))


# -- a real daemon ---------------------------------------------------------------------


def test_daemon_negotiates_or_names_both_ranges(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--device", "cpu:16MiB")
    raw = Raw(d.addr)
    try:
        msg = raw.call("hello", token=d.token(), version=9, versions=[8, 9])
        assert not msg["ok"] and msg["error"]["code"] == "BAD_REQUEST"
        assert msg["error"]["message"].startswith(
            f"the node speaks protocol {P.speaks(P.PROTOCOL_MIN, P.PROTOCOL_VERSION)}, "
            "this client speaks 8..9")
        assert msg["error"]["details"]["reason"] == "protocol_version"
    finally:
        raw.close()


@pytest.mark.parametrize("fields", [
    {"version": 1},  # a version-1 client: no ``versions``
    {"version": 2, "versions": [1, 2], "probe": b"p", "probe_addr": 4096},
    {"versions": [3, 3]},  # protocol 3: the bearer token in hello
], ids=["v1", "v2", "v3"])
def test_daemon_refuses_the_hellos_of_versions_1_to_3(  # type: ignore[no-untyped-def]
        daemon_factory, fields: dict[str, Any]) -> None:
    """An old client's hello, as it said it (the token in it), is refused
    for the fields protocol 4 does not know; nothing of it opens a session."""
    d = daemon_factory("--device", "cpu:16MiB")
    raw = Raw(d.addr)
    try:
        msg = raw.call_raw("hello", token=d.token(), **fields)
        assert not msg["ok"] and msg["error"]["code"] == "BAD_REQUEST", msg
        assert msg["error"]["message"].startswith("hello: unknown field(s)"), msg
        assert "token" in msg["error"]["message"], msg
        assert raw.call_raw("ping")["error"]["code"] == "AUTH_FAILED"
    finally:
        raw.close()


async def test_client_and_daemon_speak_the_newest(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--device", "cpu:16MiB")
    async with d.connect() as c:
        assert c.protocol_version == P.PROTOCOL_VERSION
        assert c.hello["versions"] == [P.PROTOCOL_MIN, P.PROTOCOL_VERSION]
        assert c.hello["checksum_kinds"] == {"cpu:0": "xxh3"}
        buf = await c.request_buffer(4096)
        # a verified batch (xxh3-64, the manifest's kind) with a daemon of this version
        await c.store_batch(buf, [(0, np.ones(64, np.uint8))], verify="checksum")
        await c.release_buffer(buf)


# -- an older daemon ------------------------------------------------------------------


@pytest.fixture
async def old_daemon() -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    """A daemon as it was before versions: unknown ops, unknown fields and
    any version but 1 are a bare BAD_REQUEST; the connection stays open, and
    a second hello the old way would be served."""
    hellos: list[dict[str, Any]] = []

    async def handler(conn: Conn, req: dict[str, Any]) -> None:
        hellos.append(req)
        if req["op"] != "hello":
            conn.send(P.error_response(req["id"], BadRequest(f"unknown op {req['op']!r}")))
            return
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

    fd = FakeDaemon(handler, challenges=False)
    try:
        yield await fd.start(), hellos
    finally:
        await fd.close()


async def test_the_client_says_hello_once_and_never_the_old_way(
        old_daemon: tuple[str, list[dict[str, Any]]]) -> None:
    """The refusal is the daemon's, as it came: no second hello matched on
    its wording, no session in version 1."""
    addr, hellos = old_daemon
    with pytest.raises(BadRequest, match="unknown op 'challenge'"):
        await rpcbuf.connect(addr, token=TOKEN, timeout=5, same_host=False)
    assert [h["op"] for h in hellos] == ["challenge"]  # and no hello with the token after
    assert hellos[0]["versions"] == [P.PROTOCOL_MIN, P.PROTOCOL_VERSION]
    assert "token" not in hellos[0] and hellos[0]["claims"] == TOKEN.rpartition(".")[0]


@pytest.mark.parametrize("version", [1, 2, 7, ...], ids=["v1", "v2", "v7", "none"])
async def test_a_daemon_answering_a_version_we_do_not_speak_is_refused(
        version: Any) -> None:
    async def handler(conn: Conn, req: dict[str, Any]) -> None:
        conn.answer(req, hello_answer(version=version))

    fd = FakeDaemon(handler)
    addr = await fd.start()
    try:
        with pytest.raises(BadRequest) as info:
            await rpcbuf.connect(addr, token=TOKEN, timeout=5, same_host=False)
        said = 0 if version is ... else version
        assert info.value.message.startswith(
            f"the node speaks protocol {said}, this client speaks "
            f"{P.speaks(P.PROTOCOL_MIN, P.PROTOCOL_VERSION)}")
        assert info.value.details["field"] == "version"
    finally:
        await fd.close()

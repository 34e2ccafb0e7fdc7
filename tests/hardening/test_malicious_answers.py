"""A malicious daemon after hello: what it answers is bounded and checked
before the client acts on it or prints it.  A listing that says "more" for
ever stops (it grew a client by 1 GB in 5 s), a block whose size the daemon
names is allocated only up to a cap, a lookup or a removal that does not
match the keys is BAD_REQUEST (``reason: bad_answer``), and ``rpcbuf
doctor`` and the CLI's tables print no escape sequence a daemon sent.  The
daemon is ``fakedaemon.FakeDaemon``: the real framing, hostile answers."""

from __future__ import annotations

import asyncio
import functools
import io
import os
import tempfile
import time
import tracemalloc
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from fakedaemon import TOKEN, Conn, FakeDaemon, hello_answer, send_handle, staging_fd
from rich.console import Console

import rpcbuf
from rpcbuf.cli import doctor, tables
from rpcbuf.cli.errors import sentence
from rpcbuf.control.client.blockops import list_all
from rpcbuf.control.wire.errors import BadRequest, OutOfMemory
from rpcbuf.dataplane import staging

Answers = dict[str, Callable[[dict[str, Any]], dict[str, Any]]]  # op -> result of a request

# What no terminal may receive from a peer: C0 controls (ESC, BEL, CR, ...),
# DEL, C1 controls (CSI as one character) and bidi overrides.
EVIL = "x\x1b]0;pwned\x07\x1b[2J\x1b[31m\x9b1m\r\u202e\x7fy"


def _unsafe(text: str) -> list[str]:
    return [c for c in text if not c.isprintable() and c != "\n"]


async def _serve(answers: Answers) -> AsyncIterator[str]:
    """A fake daemon on a Unix socket of its own (same host: no UCX to bind)
    that answers each op with ``answers[op](request)``; ``unix:PATH``."""
    async def handler(conn: Conn, req: dict[str, Any]) -> None:
        if req["op"] == "hello":
            conn.answer(req, hello_answer(same_host=True, handles_nonce=os.urandom(16)))
        elif req["op"] == "bind_handles":
            fd = staging_fd()
            send_handle(conn, 0, staging.SIZE, fd)
            os.close(fd)
        elif req["op"] in answers:
            result = answers[req["op"]](req)
            if "error" in result:
                conn.send({"id": req["id"], "ok": False, "error": result["error"]})
            else:
                conn.answer(req, result)
        else:
            conn.answer(req, {})

    fake = FakeDaemon(handler)
    path = os.path.join(tempfile.mkdtemp(prefix="fake-rpcbufd-"), "sock")
    server = await asyncio.start_unix_server(fake._serve, path)
    try:
        yield f"unix:{path}"
    finally:
        await fake.close()
        server.close()
        await server.wait_closed()
        os.unlink(path)
        os.rmdir(os.path.dirname(path))


async def _connected(answers: Answers) -> AsyncIterator[rpcbuf.RpcContext]:
    async for addr in _serve(answers):
        async with rpcbuf.connect(addr, token=TOKEN, timeout=5, same_host=True) as c:
            yield c


# -- listing: every page moves forward, and a listing stops ------------------------------


@pytest.mark.parametrize("page", [
    {"keys": ["a"], "more": True},  # the same page for ever (after "a": nothing moved)
    {"keys": ["bc", "bb"], "more": False},  # out of order
    {"keys": ["b"] * 2, "more": True},
    {"keys": [f"k{i}" for i in range(11)], "more": False},  # more than the 10 asked
    {"keys": ["zz"], "more": False},  # not the prefix asked
    {"keys": [EVIL], "more": False},  # not printable
    {"keys": [], "more": True},  # more after nothing
    {"keys": "abc", "more": False}, {"keys": [1, 2], "more": False},
    {"keys": ["b"], "more": "yes"},
])
async def test_a_block_list_page_is_checked(page: dict[str, Any]) -> None:
    async for c in _connected({"block_list": lambda req: page}):
        with pytest.raises(BadRequest) as info:
            await c.list_blocks(prefix="b", start_after="a", limit=10)
        assert info.value.details["reason"] == "bad_answer", info.value


async def test_a_listing_that_never_ends_stops_at_its_bounds() -> None:
    """A daemon whose every page says "more" (with keys that do move on):
    ``list_all`` (the LMCache connector's ``list``) stops at its key bound,
    incomplete, instead of growing the client for ever."""
    pages = 0

    def endless(req: dict[str, Any]) -> dict[str, Any]:
        nonlocal pages
        pages += 1
        return {"keys": [f"k{pages:09d}-{i:05d}" for i in range(req["limit"])], "more": True}

    async for c in _connected({"block_list": endless}):
        page = functools.partial(_page, c)

        keys, whole = await list_all(page, timeout=30, max_keys=20_000)
        assert not whole and 20_000 <= len(keys) < 20_000 + 4096 and pages == 5
        pages = 0
        keys, whole = await list_all(page, timeout=30, max_chars=100_000)
        assert not whole and pages == 2  # 2 pages of 4096 keys of 15 characters
        pages = 0
        t0 = time.monotonic()
        keys, whole = await list_all(page, timeout=0.3)  # the deadline, at most a page late
        assert not whole and time.monotonic() - t0 < 10


async def _page(c: rpcbuf.RpcContext, after: str | None) -> tuple[list[str], bool]:
    return await c.list_blocks(start_after=after, limit=4096)


# -- blocks: sizes the daemon names --------------------------------------------------------


async def test_get_block_allocates_only_up_to_its_cap() -> None:
    """The daemon says the block has 4 GiB: ``get_block`` without ``out``
    refuses before it allocates (it allocated whatever the daemon named)."""
    sizes = [4 << 30]
    missing = {"error": {"code": "NOT_FOUND", "message": "gone", "details": {"missing": [0]}}}
    async for c in _connected({"block_lookup": lambda req: {"sizes": list(sizes)},
                               "block_get": lambda req: missing,
                               "block_locate": lambda req: missing}):  # in place
        tracemalloc.start()
        try:
            with pytest.raises(BadRequest) as info:
                await c.get_block("k")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert info.value.details["reason"] == "too_big" and peak < 64 << 20, peak
        sizes[0] = 1000
        with pytest.raises(BadRequest, match="max_nbytes"):
            await c.get_block("k", max_nbytes=999)
        assert await c.get_block("k") is None  # under the cap: asked (and missing)


@pytest.mark.parametrize("answer,meta", [
    ({"sizes": ["12"]}, False), ({"sizes": [0]}, False), ({"sizes": [True]}, False),
    ({"sizes": [1 << 63]}, False), ({"sizes": [8, 8]}, False), ({"sizes": None}, False),
    ({"sizes": [8], "metas": []}, True), ({"sizes": [8], "metas": ["text"]}, True),
    ({"sizes": [8], "expires_at": [float("inf")]}, True),
    ({"sizes": [8], "expires_at": ["soon"]}, True),
])
async def test_a_block_lookup_that_does_not_match_the_keys_is_refused(
        answer: dict[str, Any], meta: bool) -> None:
    async for c in _connected({"block_lookup": lambda req: answer}):
        with pytest.raises(BadRequest) as info:
            await c.lookup_blocks(["k"], meta=meta)
        assert info.value.details["reason"] == "bad_answer", info.value


@pytest.mark.parametrize("removed", [2, -1, "1", None, 1.5])
async def test_a_removal_count_is_checked(removed: Any) -> None:
    async for c in _connected({"block_remove": lambda req: {"removed": removed}}):
        with pytest.raises(BadRequest) as info:
            await c.remove_blocks(["k"])
        assert info.value.details["reason"] == "bad_answer", info.value


@pytest.mark.parametrize("op,answer,call", [
    ("renew", {}, lambda c: c.renew_buffer("b-x")),  # a KeyError before
    ("renew", {"expires_at": "soon"}, lambda c: c.renew_buffer("b-x")),
    ("renew", {"expires_at": float("nan")}, lambda c: c.renew_buffer("b-x")),
    ("list_buffers", {}, lambda c: c.list_buffers()),
    ("list_buffers", {"buffers": "abc"}, lambda c: c.list_buffers()),
    ("list_buffers", {"buffers": [{"size": 5}]}, lambda c: c.list_buffers()),
])
async def test_buffer_answers_are_checked(op: str, answer: dict[str, Any], call: Any) -> None:
    async for c in _connected({op: lambda req: answer}):
        with pytest.raises(BadRequest) as info:
            await call(c)
        assert info.value.details["reason"] == "bad_answer", info.value


# -- what the CLI prints ---------------------------------------------------------------------


async def test_doctor_prints_no_escape_sequence_the_daemon_sent() -> None:
    """Hello, stats, devices and an error, each with escape sequences in
    every string: ``rpcbuf doctor``'s lines carry none of them (it printed
    them raw), and still say what the daemon said, escaped."""
    async def handler(conn: Conn, req: dict[str, Any]) -> None:
        op = req["op"]
        if op == "hello":
            conn.answer(req, hello_answer(tenant=EVIL, node_id=EVIL,
                                          ucx={"port": fake.ucx_port},
                                          same_host_why=EVIL * 3))
        elif op == "stats":
            lib = {"version": EVIL, "path": EVIL, "verbs": False, "error": EVIL}
            conn.answer(req, {"ucx_tls": EVIL, "rdma_devices": [EVIL], "listening": [EVIL],
                              "ucx": lib, "node_id": EVIL})
        elif op == "list_devices":
            conn.answer(req, {"devices": [{"key": EVIL, "device_type": "CPU", "device": 0,
                                           "total": 1 << 30, "free": 1 << 20,
                                           "largest_free": 1 << 20}]})
        elif op == "request_buffer":
            conn.send({"id": req["id"], "ok": False,
                       "error": {"code": "OUT_OF_MEMORY", "message": EVIL, "details": {}}})
        elif op == "ping":
            conn.answer(req, {"time": time.time()})
        else:
            conn.answer(req, {})

    fake = FakeDaemon(handler, ucx_listener=True)
    addr = await fake.start()
    try:
        checks = await doctor.check_node(addr, TOKEN, 10)
    finally:
        await fake.close()
    assert any(EVIL in c.message for c in checks)  # the daemon did say it
    lines = doctor.render({addr: checks}, columns=200)
    text = "\n".join(lines)
    assert _unsafe(text) == [], [line for line in lines if _unsafe(line)]
    assert "\\x1b]0;pwned\\x07" in text  # shown, escaped


def test_tables_and_error_sentences_print_no_escape_sequence() -> None:
    out = io.StringIO()
    Console(file=out, width=200, force_terminal=False).print(tables.fit(
        f"title {EVIL}", [tables.Col("id", key=True), tables.Col("name", wrap=True)],
        [[EVIL, EVIL], ["[/x]" + EVIL, 5]]))
    assert _unsafe(out.getvalue()) == [] and "\\x1b[2J" in out.getvalue()
    said = sentence("node", OutOfMemory(EVIL, {"free": 5}))
    assert _unsafe(said) == [] and "\\x9b1m" in said
    assert len(tables.clean("x" * 100_000)) < tables.CLEAN_MAX + 100

"""Fuzz the control protocol of a live daemon with raw sockets: random,
mutated and truncated frames, wrong types, huge numbers, deep nesting, random
ops with random fields.  The daemon must never die nor leak (pool free bytes
and the session count return to their start), and a valid client on its own
connection keeps getting answers throughout."""

from __future__ import annotations

import socket
import struct
import time
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from rawwire import Raw, frame, free_and_sessions, hello, release_all, scaled, wait_for

from conftest import DaemonProc
from rpcbuf.control.wire import fields, protocol as P

EXAMPLES = scaled(150, 3000)
TIME_BUDGET = scaled(25.0, 600.0)  # seconds; later examples are skipped past it

FIELDS = sorted({f for cls in P.OPS.values() for f in fields._hints(cls)} | {"x", ""})
ints = st.one_of(st.integers(-(1 << 63), (1 << 64) - 1), st.sampled_from(
    [0, 1, -1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, -(1 << 63), 1 << 40]))
scalars = st.one_of(st.none(), st.booleans(), ints, st.floats(allow_nan=True),
                    st.text(max_size=40), st.binary(max_size=64))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=8), inner, max_size=5)),
    max_leaves=20)
requests = st.fixed_dictionaries(
    {"op": st.one_of(st.sampled_from(sorted(P.OPS)), values),
     "id": st.one_of(st.integers(0, 1 << 20), values)},
    optional={f: values for f in FIELDS[:12]}).flatmap(
    lambda base: st.dictionaries(st.sampled_from(FIELDS), values, max_size=6).map(
        lambda extra: {**extra, **base}))
plausible = st.builds(  # right op, right field names, values often of the right type
    lambda op, fields: {"op": op, "id": 7, **fields},
    st.sampled_from(sorted(set(P.OPS) - {"hello"})),
    st.dictionaries(st.sampled_from(FIELDS), st.one_of(
        st.integers(0, 1 << 30), st.text(max_size=12), st.floats(0, 5), values,
        st.binary(max_size=64).filter(lambda b: len(b) % 8 == 0)), max_size=6))


# Generators for what bounds a request's work: shapes, ids, batch item lists.
dims = st.one_of(st.integers(0, 8), st.sampled_from([0, 1, (1 << 31), (1 << 62), (1 << 63) - 1]),
                 st.integers(-(1 << 63), (1 << 64) - 1))
shapes = st.one_of(st.lists(dims, max_size=6), st.lists(dims, min_size=30, max_size=3000),
                   st.lists(st.just(1 << 62), min_size=1000, max_size=20_000), values)
ids = st.one_of(st.text(max_size=80), st.sampled_from(["b-\nop=release tenant=x", "\x1b[2J",
                                                       "b-" + "A" * 24, "", "x" * 65]),
                st.text(alphabet="ABCab019-_", min_size=1, max_size=64))
item_lists = st.lists(st.tuples(st.integers(0, 1 << 40), st.integers(0, 1 << 40)),
                      max_size=200).map(lambda items: (P.pack_u64([o for o, _ in items]),
                                                       P.pack_u64([n for _, n in items])))
bounded = st.builds(
    lambda op, bid, items, shape, n: {
        "op": op, "id": 11, "buffer_id": bid, "offsets": items[0], "sizes": items[1],
        **({"names": [f"t{i}" for i in range(n)], "kind_dtypes": ["f4"], "kind_shapes": [shape],
            "hashes": P.pack_u64([1, 2] * n), "checksums": P.pack_u64([3] * n)}
           if op == "dedup_store" else {}),
        **({"names": [f"t{i}" for i in range(n)], "kind_dtypes": ["u1"],
            "kind_shapes": [shape]} if op == "store_batch" else {})},
    st.sampled_from(["dedup_store", "store_batch", "read_batch"]), ids, item_lists, shapes,
    st.integers(0, 3))


def deep(n: int) -> bytes:
    body = b"\x91" * n + b"\xc0"  # n nested one-element arrays around nil
    return struct.pack("!I", len(body)) + body


@st.composite
def attacks(draw: st.DrawFn) -> tuple[bool, bytes]:
    """(say hello first?, bytes to send)."""
    kind = draw(st.sampled_from(["garbage", "frames", "mutated", "truncated", "header",
                                 "deep", "plausible", "bounds"]))
    authed = draw(st.booleans()) if kind not in ("plausible", "bounds") else True
    if kind == "garbage":
        return authed, draw(st.binary(max_size=300))
    if kind == "frames":
        msgs = draw(st.lists(st.one_of(requests, values), min_size=1, max_size=4))
        return authed, b"".join(frame(m) for m in msgs)
    if kind == "plausible":
        return True, b"".join(frame(m) for m in draw(st.lists(plausible, min_size=1,
                                                              max_size=4)))
    if kind == "bounds":
        return True, b"".join(frame(m) for m in draw(st.lists(bounded, min_size=1,
                                                              max_size=3)))
    good = frame(draw(st.one_of(requests, plausible)))
    if kind == "mutated":
        data = bytearray(good)
        for _ in range(draw(st.integers(1, 6))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] = draw(st.integers(0, 255))
        return authed, bytes(data)
    if kind == "truncated":
        return authed, good[:draw(st.integers(0, len(good) - 1))]
    if kind == "header":
        n = draw(st.sampled_from([0, 1, 3, (1 << 32) - 1, 16 << 20, (16 << 20) + 1]))
        return authed, struct.pack("!I", n) + draw(st.binary(max_size=40))
    return authed, deep(draw(st.sampled_from([10, 500, 1025, 5000, 100_000])))


@pytest.fixture(scope="module")
def fuzz_daemon(daemon_factory) -> DaemonProc:  # type: ignore[no-untyped-def]
    return daemon_factory(  # type: ignore[no-any-return]
        "--device", "cpu:64MiB", "--default-quota", "*:32MiB:200")


def test_fuzzed_frames_never_kill_or_leak(fuzz_daemon: DaemonProc) -> None:
    d = fuzz_daemon
    probe = hello(d.addr, d.token("fuzz"))  # stats count the fuzz tenant's own sessions
    start = free_and_sessions(probe)
    fuzz_probe = hello(d.addr, d.token("fuzz"))
    started = time.monotonic()
    seen: dict[str, int] = {"examples": 0, "closed_by_daemon": 0}

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(attacks())
    def one(attack: tuple[bool, bytes]) -> None:
        if time.monotonic() - started > TIME_BUDGET:
            return
        authed, data = attack
        seen["examples"] += 1
        raw = hello(d.addr, d.token("fuzz")) if authed else Raw(d.addr)
        try:
            raw.send(data)
            raw.sock.shutdown(socket.SHUT_WR)
            # The daemon answers what it can, then closes: EOF, never a hang.
            assert raw.drain_to_eof(15.0), f"daemon kept the connection open after {data[:80]!r}"
        except (ConnectionResetError, BrokenPipeError):
            seen["closed_by_daemon"] += 1
        finally:
            raw.close()
        assert d.proc.poll() is None, d.log()[-3000:]
        pong = probe.call("ping")  # a valid client is served throughout
        assert pong["ok"], pong

    one()
    print(f"fuzz: {seen} in {time.monotonic() - started:.1f}s")
    assert seen["examples"] >= min(20, EXAMPLES)
    release_all(fuzz_probe)  # named/leased buffers the fuzzer made outlive its sessions
    fuzz_probe.close()
    end = wait_for(probe, start)
    probe.close()
    assert end == start, f"leak: free/sessions {start} -> {end}"
    assert "Traceback" not in d.log(), d.log()[-5000:]


def test_answers_to_bad_requests_keep_the_connection(fuzz_daemon: DaemonProc) -> None:
    """Wrong types and huge numbers in a well-formed frame: BAD_REQUEST on that
    request, and the same connection still answers."""
    raw = hello(fuzz_daemon.addr, fuzz_daemon.token("fuzz"))
    bad: list[dict[str, Any]] = [
        {"op": "request_buffer", "id": 1, "size": (1 << 64) - 1},
        {"op": "request_buffer", "id": 2, "size": -1},
        {"op": "request_buffer", "id": 3, "size": "10"},
        {"op": "request_buffer", "id": 4, "size": 10, "timeout": float("inf")},
        {"op": "request_buffer", "id": 5, "size": 10, "ttl": float("nan")},
        {"op": "read", "id": 6, "buffer_id": ["x"], "offset": 0, "nbytes": 1},
        {"op": "store_batch", "id": 7, "buffer_id": "b", "offsets": b"1234567", "sizes": b""},
        {"op": "release", "id": 8, "buffer_id": "x" * 5000},
        {"op": "nope", "id": 9},
        {"op": "ping", "id": 10, "extra": 1},
        {"op": "request_buffer", "id": 11, "size": 1 << 62},
    ]
    for msg in bad:
        raw.send(frame(msg))
        answer = raw.recv()
        assert answer is not None and answer["id"] == msg["id"] and not answer["ok"], msg
        assert answer["error"]["code"] in ("BAD_REQUEST", "OUT_OF_MEMORY", "QUOTA_EXCEEDED"), \
            (msg, answer)
    assert raw.call("ping")["ok"]
    raw.send(msgpack.packb([1, 2]))  # unframed junk: the stream is broken, the daemon closes
    raw.sock.shutdown(socket.SHUT_WR)
    assert raw.drain_to_eof(10.0)
    raw.close()

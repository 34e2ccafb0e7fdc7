"""The wire protocol, with no I/O: framing, limits and request validation."""

from __future__ import annotations

import struct
import tracemalloc

import msgpack
import pytest
from hypothesis import given, strategies as st

from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.errors import BadRequest, NotFound, RpcBufError, error_from_wire
from rpcbuf.control.wire.frames import MAX_CONTAINER, FrameDecoder, FrameError, encode_frame

messages = st.dictionaries(
    st.text(max_size=8),
    st.recursive(
        st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=20)
        | st.binary(max_size=40),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner,
                                                                     max_size=4),
        max_leaves=10,
    ),
    max_size=6,
)


@given(st.lists(messages, max_size=5), st.data())
def test_same_messages_whole_or_split(msgs: list[dict[str, object]], data: st.DataObject) -> None:
    stream = b"".join(P.encode_frame(m) for m in msgs)
    whole = P.FrameDecoder().feed(stream)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    dec = P.FrameDecoder()
    pieces: list[object] = []
    prev = 0
    for c in [*cuts, len(stream)]:
        pieces += dec.feed(stream[prev:c])
        prev = c
    assert whole == pieces == msgs
    assert dec.pending == 0


def test_byte_at_a_time() -> None:
    frame = P.encode_frame(P.Store("b-1", 7, 9, checksum=2**64 - 1, verify="checksum").to_wire(5))
    dec = P.FrameDecoder()
    out = [m for b in frame for m in dec.feed(bytes([b]))]
    req_id, req = P.parse_request(out[0])
    assert req_id == 5 and req == P.Store("b-1", 7, 9, checksum=2**64 - 1, verify="checksum")


def test_oversized_frame_is_refused_from_its_header() -> None:
    dec = P.FrameDecoder(max_frame=1024)
    with pytest.raises(P.FrameError, match="exceeds"):
        dec.feed(struct.pack("!I", 1025))  # refused before the body arrives
    with pytest.raises(P.FrameError):
        P.encode_frame({"x": b"a" * 2048}, max_frame=1024)


@pytest.mark.parametrize("body", [b"\xc1", b"\x92\x01\x02", b"\xa3abc", b"\x81\xa1a"])
def test_garbage_and_non_maps_are_frame_errors(body: bytes) -> None:
    with pytest.raises(P.FrameError):
        P.FrameDecoder().feed(struct.pack("!I", len(body)) + body)


def test_messages_before_a_break_are_kept() -> None:
    dec = P.FrameDecoder(max_frame=64)
    good = P.encode_frame({"op": "ping", "id": 1})
    assert dec.feed(good + struct.pack("!I", 65)) == [{"op": "ping", "id": 1}]
    assert isinstance(dec.error, P.FrameError)
    with pytest.raises(P.FrameError):
        dec.feed(good)


def test_truncated_frame_waits_for_more() -> None:
    frame = P.encode_frame({"op": "ping", "id": 1})
    dec = P.FrameDecoder()
    assert dec.feed(frame[:-1]) == []
    assert dec.pending == len(frame) - 1


@pytest.mark.parametrize(
    ("msg", "match"),
    [
        ({"op": "nope", "id": 1}, "unknown op"),
        ({"op": "store", "id": 1, "buffer_id": "b", "offset": -1, "nbytes": 1}, "offset"),
        ({"op": "store", "id": 1, "buffer_id": "b", "offset": True, "nbytes": 1}, "offset"),
        ({"op": "store", "id": 1, "buffer_id": "b", "offset": 2**63, "nbytes": 1}, "offset"),
        ({"op": "store", "id": 1, "buffer_id": 3, "offset": 0, "nbytes": 1}, "buffer_id"),
        ({"op": "store", "id": 1, "buffer_id": "b", "offset": 0}, "missing"),
        ({"op": "store", "id": 1, "buffer_id": "b", "offset": 0, "nbytes": 1, "x": 1}, "unknown"),
        ({"op": "store", "id": 1, "buffer_id": "b", "offset": 0, "nbytes": 1, "verify": "md5"},
         "verify"),
        ({"op": "request_buffer", "id": 1, "size": 1, "timeout": float("nan")}, "timeout"),
        ({"op": "request_buffer", "id": 1, "size": "1GiB"}, "size"),
        ({"op": "request_buffer", "id": 1, "size": 1, "name": "x" * 5000}, "name"),
    ],
)
def test_bad_requests_keep_their_id(msg: dict[str, object], match: str) -> None:
    with pytest.raises(P.RequestError, match=match) as info:
        P.parse_request(msg)
    assert info.value.req_id == 1 and isinstance(info.value.error, BadRequest)


LOAD = {"op": "load_file", "id": 1, "buffer_id": "b", "path": "m.gguf", "file_size": 8,
        "file_offsets": P.pack_u64([0]), "offsets": P.pack_u64([0]), "sizes": P.pack_u64([8]),
        "hashes": P.pack_u64([1, 2]), "checksums": P.pack_u64([3]), "names": ["t"],
        "kind_dtypes": ["u1"], "kind_shapes": [[8]]}


@pytest.mark.parametrize(("path", "match"), [
    ("../etc/passwd", "components"), ("a/../../b", "components"), ("a//b", "components"),
    ("./a", "components"), ("a/", "components"), ("/", "components"), ("", "printable path"),
    ("a\nop=release", "printable path"), ("x" * 1025, "printable path"), (7, "printable path"),
    (b"model", "printable path"), (None, "missing"),
])
def test_load_file_paths_are_checked_at_parse_time(path: object, match: str) -> None:
    msg = {k: v for k, v in LOAD.items() if k != "path" or path is not None}
    if path is not None:
        msg["path"] = path
    with pytest.raises(P.RequestError, match=match) as info:
        P.parse_request(msg)
    assert info.value.req_id == 1


@pytest.mark.parametrize("path", ["model.safetensors", "llama/shard-1.safetensors",
                                  "/srv/models/llama.gguf", "a b/é.gguf", "x" * 1024])
def test_load_file_paths_that_parse(path: str) -> None:
    _, req = P.parse_request({**LOAD, "path": path})
    assert isinstance(req, P.LoadFile) and req.path == path


@pytest.mark.parametrize(("field", "value", "match"), [
    ("file_size", -1, "file_size"), ("file_size", "8", "file_size"),
    ("file_offsets", [0], "file_offsets"), ("file_offsets", b"1234567", "file_offsets"),
    ("hashes", 5, "hashes"), ("names", "t", "names"), ("kind_shapes", [[-1]], "kind_shapes"),
    ("sizes", P.pack_u64([0] * (P.MAX_ITEMS + 1)), "sizes"), ("x", 1, "unknown"),
])
def test_load_file_fields_are_typed(field: str, value: object, match: str) -> None:
    with pytest.raises(P.RequestError, match=match):
        P.parse_request({**LOAD, field: value})


@pytest.mark.parametrize("msg", [{"op": "ping"}, {"op": "ping", "id": "1"},
                                 {"op": "ping", "id": -3}])
def test_request_without_valid_id(msg: dict[str, object]) -> None:
    with pytest.raises(P.RequestError) as info:
        P.parse_request(msg)
    assert info.value.req_id is None


def test_every_op_round_trips() -> None:
    samples = [P.Hello(b"p" * 32), P.Challenge("h.p", b"n" * 32, [4, 4]),
               P.RequestBuffer(10, "GPU", 1, 2.5, 3.0, "n"), P.GetBufferMeta("b"),
               P.Store("b", 0, 1), P.Read("b", 1, 2), P.Release("b"), P.Renew("b", 1.0),
               P.ListDevices(), P.ListBuffers(), P.Stats(), P.Ping(),
               P.StoreBatch("b", P.pack_u64([0, 8]), P.pack_u64([8, 8]), P.pack_u64([1, 2]),
                            "checksum", ["a", "b"], kinds=P.pack_u64([0, 1]),
                            kind_dtypes=["<f4", "<i8"], kind_shapes=[[2], [1]]),
               P.ReadBatch("b", P.pack_u64([0]), P.pack_u64([4])), P.OpenBuffer("n"),
               P.ClearBuffer("b", 7, 1, 2), P.CopyBuffer("a", 1, "b", 2, 3),
               P.CloneBuffer("a", "n", 5.0),
               P.DedupStore("b", P.pack_u64([0]), P.pack_u64([8]), P.pack_u64([1, 2]),
                            P.pack_u64([3]), ["a"], ["<f4"], [[2]]),
               P.BindHandles(b"n" * 16), P.Attach("b"), P.Detach("b"),
               P.MapBuffer("b"), P.MapBuffer("b", explicit=True), P.UnmapBuffer("b"),
               P.Hello(b"p" * 32, handles=True), P.Store("b", 0, 1, path="staged", stage=3),
               P.LoadFile("b", "llama/model.safetensors", 100, P.pack_u64([8]), P.pack_u64([0]),
                          P.pack_u64([8]), P.pack_u64([1, 2]), P.pack_u64([3]), ["a"],
                          ["<f4"], [[2]]),
               P.BlockPut(["k/1", "k/2"], P.pack_u64([4, 8]), P.pack_u64([1, 2]),
                          [b"m", b""], 3.0, "CPU", 0, "staged", 5),
               P.BlockGet(["k"], P.pack_u64([4]), "staged", 0xFFFF),
               P.Read("b", 1, 2, path="inline"),
               P.BlockLookup(["k"], True), P.BlockRemove(["a", "b"]),
               P.BlockList("k/", "k/1", 10), P.BlockAttach("k/1"),
               P.BlockPlace(["k/1"], P.pack_u64([4]), "CPU", 0),
               P.BlockCommit(3, P.pack_u64([1]), [b"m"], 2.0, None),
               P.BlockLocate(["k/1"], P.pack_u64([4])), P.BlockUnpin(3)]
    assert {type(s) for s in samples} == set(P.OPS.values())
    for i, s in enumerate(samples):
        wire = msgpack.unpackb(msgpack.packb(s.to_wire(i)))
        assert P.parse_request(wire) == (i, s)


@pytest.mark.parametrize("keys", [
    [], "k", ["k"] * (P.MAX_BLOCK_KEYS + 1), [""], ["x" * (P.MAX_BLOCK_KEY + 1)], [b"k"],
    ["a", 1], ["line\nbreak"], None,
])
def test_block_keys_are_bounded_at_parse_time(keys: object) -> None:
    with pytest.raises(P.RequestError, match="keys") as info:
        P.parse_request({"op": "block_lookup", "id": 4, "keys": keys})
    assert info.value.req_id == 4


def test_block_keys_that_parse() -> None:
    keys = [f"model@1@0@{i:x}" for i in range(P.MAX_BLOCK_KEYS - 1)] + ["é" * P.MAX_BLOCK_KEY]
    _, req = P.parse_request({"op": "block_remove", "id": 1, "keys": keys})
    assert isinstance(req, P.BlockRemove) and req.keys == keys


def test_errors_travel_by_code() -> None:
    exc = error_from_wire(NotFound("gone", {"x": 1}).to_wire())
    assert type(exc) is NotFound and exc.details == {"x": 1} and exc.code == "NOT_FOUND"
    unknown = error_from_wire({"code": "FROM_THE_FUTURE", "message": "m"})
    assert type(unknown) is RpcBufError and unknown.details["code"] == "FROM_THE_FUTURE"
    assert type(error_from_wire("junk")) is RpcBufError


def test_one_message_at_a_time_under_a_limit_that_changes() -> None:
    """The daemon parses one frame at a time until hello succeeds, under a
    small limit, then raises it: a big frame pipelined right behind the hello
    is judged by the limit that holds once the hello was handled."""
    hello = P.encode_frame({"op": "hello", "id": 1, "token": "t", "version": 1})
    big = P.encode_frame({"op": "ping", "id": 2, "pad": "x" * 10_000})
    dec = P.FrameDecoder(P.HELLO_MAX_FRAME, why=" before hello")
    assert [m["id"] for m in dec.feed(hello + big, most=1)] == [1]
    dec.max_frame, dec.why = P.DEFAULT_MAX_FRAME, ""
    assert [m["id"] for m in dec.feed(b"")] == [2]
    strict = P.FrameDecoder(P.HELLO_MAX_FRAME, why=" before hello")
    with pytest.raises(P.FrameError, match="before hello"):
        strict.feed(big)


@pytest.mark.parametrize("names", [
    ["a", 7], ["a", None], ["ok", "line\nbreak"], ["esc\x1b[31m"], ["x" * (P.MAX_STR + 1)],
    [b"bytes"], "not a list",
])
def test_string_lists_are_checked_item_by_item(names: object) -> None:
    """Names and dtypes of a big batch (checked in C calls: one join, one
    printability test, one max length): any non-string, non-printable or
    overlong item refuses the request."""
    msg = {"op": "store_batch", "id": 1, "buffer_id": "b1", "offsets": b"", "sizes": b"",
           "names": names}
    with pytest.raises(P.RequestError):
        P.parse_request(msg)


def test_string_lists_that_are_fine_pass() -> None:
    names = ["layers.0.w", "é-ünïcode", "x" * P.MAX_STR, ""]
    msg = {"op": "store_batch", "id": 1, "buffer_id": "b1", "offsets": b"", "sizes": b"",
           "names": names}
    _, req = P.parse_request(msg)
    assert req.names == names  # type: ignore[attr-defined]


def _nested(depth: int, fill: bytes, n: int) -> bytes:
    """``depth`` arrays, each of ``n`` ``fill`` objects and then the next:
    nothing closes until the innermost does (a count taken as containers
    close saw none of it until 16.7 million maps were built)."""
    head = b"\xdd" + struct.pack("!I", n + 1) + fill * n
    return head * depth + b"\x90"


@pytest.mark.parametrize("bomb", [
    msgpack.packb([{}] * 2_000_000),            # one byte per empty map, ~70 bytes decoded
    msgpack.packb([[[]] * 1000] * 2000),        # many short containers
    msgpack.packb([""] * (MAX_CONTAINER + 1)),  # one container past its own bound
    _nested(20, b"\x80", 100_000),              # nested: no container closes early
    _nested(20, b"\xa2ab", 60_000),             # nested strings (scalars count too)
    _nested(20, b"\xc7\x00\x05", 60_000),       # zero-length ext types
    b"\x91" * 40 + b"\x90" + b"\xc0" * 70_000,  # deep, then filler past the scan's size
], ids=["maps", "lists", "long", "nested-maps", "nested-strings", "ext", "deep"])
def test_a_frame_is_bounded_in_objects_not_only_bytes(bomb: list[object]) -> None:
    """A 16 MiB frame of empty maps made the decoder build 1.1 GiB and hold
    the loop for seconds: the items of one frame are bounded, and a frame past
    the bound is refused having built at most one container past it."""
    body = b"\x83\xa2op\xa4ping\xa2id\x01\xa1x" + bomb
    frame = struct.pack("!I", len(body)) + body
    dec = FrameDecoder()
    tracemalloc.start()
    try:
        with pytest.raises(FrameError, match=r"objects|deep|exceeds|ext type|ExtraData"):
            dec.feed(frame)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * len(frame) + (1 << 20)  # copies of the bytes, nothing built


def test_a_frame_within_the_object_bound_decodes() -> None:
    names = [f"layer.{i}.weight" for i in range(100_000)]
    shapes = [[i, 2, 3, 4] for i in range(100_000)]  # every shape distinct
    msg = {"op": "ping", "id": 1, "names": names, "shapes": shapes}
    assert FrameDecoder().feed(encode_frame(msg)) == [msg]


def _deep(n: int) -> object:
    value: object = 1
    for _ in range(n):
        value = [value]
    return value


@pytest.mark.parametrize("msg", [
    {"op": "hello", "id": 1, "versions": _deep(1000)},  # raised RecursionError, unanswered
    {"op": "request_buffer", "id": 2, "size": [[1.5] * 100] * 9000},  # a 4.5 MB sentence
    {"op": [[1] * 10] * 10_000, "id": 3},
])
def test_a_refusal_quotes_a_bounded_value(msg: dict[str, object]) -> None:
    with pytest.raises(P.RequestError) as info:
        P.parse_request(msg)
    assert info.value.error.code == "BAD_REQUEST"
    assert len(info.value.error.message) < 300


def test_only_stores_on_the_ucx_path_send_ucx_messages() -> None:
    """The janitor spares unexpected UCX messages while a request that sends
    some has not posted its receives: a dedup store sends none (issue 39,
    item 6: it held the sweep off for a whole dedup)."""
    u64 = P.pack_u64([0])
    assert P.sends_over_ucx(P.Store("b", 0, 8))
    assert P.sends_over_ucx(P.StoreBatch("b", u64, u64))
    assert P.sends_over_ucx(P.BlockPut(["k"], u64, u64))
    assert not P.sends_over_ucx(P.Store("b", 0, 8, path="staged", stage=0))
    assert not P.sends_over_ucx(P.Store("b", 0, 8, path="inline", data=P.Inline(b"x" * 8)))
    assert not P.sends_over_ucx(P.DedupStore("b", u64, u64, P.pack_u64([0, 0]), u64, ["t"],
                                             ["u1"], [[8]]))
    assert not P.sends_over_ucx(P.Read("b", 0, 8))
